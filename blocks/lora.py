"""LoRA adapters on a span: PEFT's on-disk format read by us, only the tensors of the span's blocks
loaded, applied beside the shared base weights (never merged into them), so one span serves
several adapters and plain requests at once.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, as
`PeftModel.save_pretrained` writes them. A targeted linear layer y = W x computes

    y = W x + scaling * B (A x),   scaling = lora_alpha / r   (lora_alpha / sqrt(r) if use_rslora)

with A [r, in] and B [out, r]. `fan_in_fan_out` only says how the *base* weight is stored (GPT-2's
Conv1D); PEFT's unmerged LoRA path is the same product either way, so it changes nothing here.
Which adapter a forward uses is chosen per call (`use_adapter`), per thread, so concurrent
sessions on one span may each use another adapter or none.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig

from blocks.errors import BlocksError
from blocks.families import Family

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT saves every tensor under the wrapped model's own names behind this prefix.
PEFT_PREFIX = "base_model.model."
MAX_ADAPTER_NAME_LEN = 256  # wire.ServerInfo.adapters holds names up to this long

# Config fields whose non-default values change the math in ways this module does not do.
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "use_qalora": "QALoRA",
    "use_bdlora": "block-diagonal LoRA",
    "lora_bias": "LoRA bias terms",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on raw parameters such as MoE experts)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
}

_active: contextvars.ContextVar[str | None] = contextvars.ContextVar("lora_adapter", default=None)


class AdapterError(BlocksError, ValueError):
    """An adapter directory peerd cannot serve; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter directory holds, read from its config and its tensors' names only."""

    name: str
    path: Path
    r: int
    scaling: float
    tensor_names: tuple[str, ...]


def adapter_name(path: Path) -> str:
    """An adapter is known by its directory's name."""
    return path.resolve().name


def read_adapter(path: str | Path, config: PretrainedConfig, family: Family) -> AdapterInfo:
    """Check an adapter directory against a model without reading its tensors' values:
    AdapterError for anything peerd cannot apply exactly (other PEFT types, DoRA, modules outside
    the decoder blocks, blocks the model does not have)."""
    path = Path(path).expanduser()
    name = adapter_name(path)
    _check_files(path, name)
    settings = _read_settings(path, name)
    r, scaling = _rank_and_scaling(settings, name)
    with safe_open(path / WEIGHTS_FILE, framework="pt") as f:
        shapes = {tensor: list(f.get_slice(tensor).get_shape()) for tensor in f.keys()}  # noqa: SIM118
    if not shapes:
        raise AdapterError(f"adapter {name}: {WEIGHTS_FILE} holds no tensors")
    info = AdapterInfo(name, path.resolve(), r, scaling, tuple(shapes))
    _check_matrices(info, shapes, config, family)
    return info


def _check_files(path: Path, name: str) -> None:
    if not (path / CONFIG_FILE).is_file():
        raise AdapterError(
            f"{path} is not a PEFT adapter: it has no {CONFIG_FILE} (save one with "
            "peft_model.save_pretrained(dir))"
        )
    if not (path / WEIGHTS_FILE).is_file():
        raise AdapterError(
            f"adapter {name}: {path} has no {WEIGHTS_FILE}; peerd reads safetensors only (save "
            "with safe_serialization=True, the default)"
        )
    if not 1 <= len(name) <= MAX_ADAPTER_NAME_LEN:
        raise AdapterError(f"adapter directory name {name!r} must be 1 to 256 characters")


def _read_settings(path: Path, name: str) -> dict[str, Any]:
    """The adapter's config, if it is a plain LoRA peerd applies exactly."""
    try:
        settings = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name}: cannot read {CONFIG_FILE}: {e}") from e
    if not isinstance(settings, dict):
        raise AdapterError(f"adapter {name}: {CONFIG_FILE} must hold a JSON object")
    kind = settings.get("peft_type")
    if kind != "LORA":
        raise AdapterError(
            f"adapter {name} is of PEFT type {kind!r}; peerd serves LORA adapters only"
        )
    for key, what in _UNSUPPORTED.items():
        if settings.get(key):
            raise AdapterError(
                f"adapter {name} uses {what}, which peerd does not apply; save a plain LoRA "
                f"adapter (without {key})"
            )
    if settings.get("bias", "none") != "none":
        raise AdapterError(
            f"adapter {name} trains biases (bias={settings['bias']!r}); peerd applies plain "
            "LoRA only: train it with bias='none'"
        )
    return settings


def _rank_and_scaling(settings: dict[str, Any], name: str) -> tuple[int, float]:
    r, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise AdapterError(f"adapter {name}: r must be an int >= 1 and lora_alpha a number")
    scaling = alpha / math.sqrt(r) if settings.get("use_rslora") else alpha / r
    return r, float(scaling)


def _check_matrices(
    info: AdapterInfo, shapes: dict[str, list[int]], config: PretrainedConfig, family: Family
) -> None:
    """AdapterError unless every tensor is the A or B half of a pair, both present, for a linear
    layer of a block the model has, in that layer's shape."""
    # A layer on the meta device (no memory) tells whether each matrix fits, so a wrong adapter
    # fails here and not after joining. Blocks may differ (Qwen2-MoE's dense and sparse MLPs):
    # each is checked against a layer of its own index.
    layers: dict[int, nn.Module] = {}
    num_blocks = int(config.num_hidden_layers)
    halves: dict[tuple[int, str], str] = {}
    for tensor_name, shape in shapes.items():
        block, module, which = _parse(tensor_name, family, info.name)
        halves[(block, module)] = halves.get((block, module), "") + which
        if not 0 <= block < num_blocks:
            raise AdapterError(
                f"adapter {info.name} changes block {block}, but the model has blocks "
                f"0:{num_blocks}: it was trained for another model"
            )
        if block not in layers:
            with torch.device("meta"):
                layers[block] = family.layer_class(config, layer_idx=block)
        base = _linear(layers[block], module, info.name, block)
        a_shape = shape if which == "A" else [info.r, base.in_features]
        b_shape = shape if which == "B" else [base.out_features, info.r]
        _check_pair(info, block, module, base, a_shape, b_shape)
    for (block, module), which in halves.items():
        if sorted(which) != ["A", "B"]:
            raise AdapterError(
                f"adapter {info.name}: block {block} {module} has lora_{which} only; save the "
                "adapter again with PEFT"
            )


def _check_pair(
    info: AdapterInfo,
    block: int,
    module: str,
    base: nn.Linear | LoraLinear,
    a_shape: Sequence[int],
    b_shape: Sequence[int],
) -> None:
    """AdapterError unless A is [r, in] and B [out, r] for the linear layer `base`."""
    if list(a_shape) != [info.r, base.in_features] or list(b_shape) != [base.out_features, info.r]:
        raise AdapterError(
            f"adapter {info.name}: block {block} {module} is a {base.in_features}->"
            f"{base.out_features} linear layer, but the adapter (r={info.r}) has A "
            f"{list(a_shape)} and B {list(b_shape)}: it was trained for another model"
        )


def _parse(tensor_name: str, family: Family, adapter: str) -> tuple[int, str, str]:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' ->
    (3, 'self_attn.q_proj', 'A'); AdapterError for a tensor outside the decoder blocks."""
    inner = tensor_name.removeprefix(PEFT_PREFIX)
    layer = re.escape(family.layer_prefix).replace(re.escape("{}"), r"(\d+)")
    pattern = rf"(?:{re.escape(family.root)})?{layer}(.+)\.lora_([AB])(?:\.[^.]+)?\.weight"
    match = re.fullmatch(pattern, inner)
    if match is None:
        module = re.sub(r"(\.base_layer)?(\.lora_[AB](\.[^.]+)?)?\.(weight|bias)$", "", inner)
        raise AdapterError(
            f"adapter {adapter} changes {module!r}, which is not a LoRA matrix of a decoder block "
            "(the embeddings and the LM head run on each client, not on servers): peerd serves "
            "adapters whose target_modules all lie inside the blocks"
        )
    return int(match.group(1)), match.group(2), match.group(3)


class LoraLinear(nn.Module):
    """A base nn.Linear plus any number of named LoRA pairs; the adapter `use_adapter` names for
    the calling thread is added to the base output, none when it names none."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def weight(self) -> torch.Tensor:  # layers that read their projections' weights still can
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        self.pairs[name] = (a, b, scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        name = _active.get()
        if name is None or name not in self.pairs:
            return out
        a, b, scaling = self.pairs[name]
        return out + F.linear(F.linear(x.to(a.dtype), a), b).to(out.dtype) * scaling


@contextlib.contextmanager
def use_adapter(name: str | None) -> Iterator[None]:
    """Forwards in this block (this thread) add adapter `name` (None: the base model alone)."""
    token = _active.set(name)
    try:
        yield
    finally:
        _active.reset(token)


def attach_adapter(
    layers: Sequence[nn.Module], start: int, info: AdapterInfo, family: Family
) -> int:
    """Load the LoRA matrices of blocks start..start+len(layers)-1 (only those tensors) and hang
    them on the layers' linear modules, wrapping each in a LoraLinear once. Returns how many
    modules got the adapter; AdapterError if a module is missing or shapes do not fit."""
    end = start + len(layers)
    mine: dict[tuple[int, str], dict[str, str]] = {}
    for tensor_name in info.tensor_names:
        block, module, which = _parse(tensor_name, family, info.name)
        if start <= block < end:
            mine.setdefault((block, module), {})[which] = tensor_name
    # The serving dtype: a quantized block's first parameter may hold int8 or 4-bit codes.
    first = next(p for p in layers[0].parameters() if p.is_floating_point())
    with safe_open(info.path / WEIGHTS_FILE, framework="pt", device=str(first.device)) as f:
        for (block, module), pair in sorted(mine.items()):
            if set(pair) != {"A", "B"}:
                raise AdapterError(
                    f"adapter {info.name}: block {block} {module} has lora_{''.join(pair)} only"
                )
            a = f.get_tensor(pair["A"]).to(first.dtype)
            b = f.get_tensor(pair["B"]).to(first.dtype)
            target = _linear(layers[block - start], module, info.name, block)
            base = target.base if isinstance(target, LoraLinear) else target
            _check_pair(info, block, module, base, a.shape, b.shape)
            if not isinstance(target, LoraLinear):
                target = _wrap(layers[block - start], module)
            target.add(info.name, a, b, info.scaling)
    return len(mine)


def _linear(layer: nn.Module, module: str, adapter: str, block: int) -> nn.Linear | LoraLinear:
    try:
        target = layer.get_submodule(module)
    except AttributeError:
        target = None
    if isinstance(target, LoraLinear | nn.Linear):
        return target
    raise AdapterError(
        f"adapter {adapter} targets {module!r} in block {block}, which is not a linear layer of "
        f"this model's blocks ({type(layer).__name__}): it was trained for another architecture"
    )


def _wrap(layer: nn.Module, module: str) -> LoraLinear:
    parent_name, _, child = module.rpartition(".")
    parent = layer.get_submodule(parent_name) if parent_name else layer
    wrapped = LoraLinear(getattr(parent, child))
    setattr(parent, child, wrapped)
    return wrapped
