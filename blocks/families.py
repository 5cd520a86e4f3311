"""Model families: which transformers decoder layer runs a block, how the weights are named, and
how positions reach a layer (rotary embeddings or ALiBi). One registry, keyed by config.model_type.

The layer math is transformers' own; a family only supplies what the transformers *model* class
would have handed each layer (masks, positions, ALiBi) so a span can run layers a..b on their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.models.bloom import modeling_bloom
from transformers.models.falcon import modeling_falcon
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral

from blocks.errors import UnsupportedModelError

# What a family gives a layer besides hidden states and the KV cache: masks, positions, ALiBi.
LayerInputs = Callable[[PretrainedConfig, nn.Module | None, torch.Tensor, int], dict[str, Any]]
# The same for rows of one forward that differ in past length and left padding (see RowMasks).
MaskedInputs = Callable[
    [PretrainedConfig, nn.Module | None, torch.Tensor, "RowMasks"], dict[str, Any]
]


@dataclass(frozen=True)
class RowMasks:
    """Where each row of a forward stands, for rows with their own past lengths and padding.

    `allowed[r, 0, q, k]`: query q of row r may attend to key k (causal, not padding, within the
    sliding window; a query always sees its own key, so a padding query never attends to nothing
    and never turns into NaN). `position_ids[r, q]`: its position counted without the row's
    padding. `key_valid[r, k]`: key k of row r is a real token (ALiBi counts those).
    """

    allowed: torch.Tensor  # bool [rows, 1, queries, keys]
    position_ids: torch.Tensor  # long [rows, queries]
    key_valid: torch.Tensor  # bool [rows, keys]

    @staticmethod
    def build(
        past: torch.Tensor, pads: torch.Tensor, queries: int, keys: int, window: int | None
    ) -> RowMasks:
        """Masks for rows whose new tokens start at `past[r]` (absolute, padding included) and
        whose first `pads[r]` positions are left padding."""
        absolute = past[:, None] + torch.arange(queries, device=past.device)[None]  # [rows, q]
        key = torch.arange(keys, device=past.device)[None, None]  # [1, 1, k]
        at = absolute[..., None]
        allowed = (key <= at) & (key >= pads[:, None, None])
        if window is not None:  # transformers counts the window over absolute positions
            allowed &= key > at - window
        allowed |= key == at
        return RowMasks(
            allowed=allowed[:, None],
            position_ids=(absolute - pads[:, None]).clamp(min=0),
            key_valid=key[0] >= pads[:, None],
        )


@dataclass(frozen=True)
class Family:
    name: str
    covers: str  # the models it runs, for people reading errors and docs
    layer_class: type[nn.Module]
    # Weight names, relative to `root` ("model." / "transformer."), which some checkpoints omit.
    root: str
    layer_prefix: str  # formatted with the block index: "layers.{}."
    embed: str  # module path of the token embedding
    final_norm: str
    lm_head: str  # outside root
    embed_norm: str | None  # a norm right after the embedding (bloom)
    attn_implementation: str  # the attention kernel and the mask format that goes with it
    cache_kwarg: str  # the name under which the layer takes its KV cache
    make_norm: Callable[[PretrainedConfig], nn.Module]
    make_rotary: Callable[[PretrainedConfig], nn.Module | None]
    layer_inputs: LayerInputs
    masked_inputs: MaskedInputs
    kv_width: Callable[[PretrainedConfig], int]  # key (= value) features cached per token per layer
    convert_block: Callable[[dict[str, torch.Tensor], PretrainedConfig], dict[str, torch.Tensor]]
    experts_implementation: str | None = None  # mixture-of-experts kernel, as transformers picks

    def prefix(self, names: Iterable[str]) -> str:
        """`root` if the checkpoint's names carry it (save_pretrained writes it), else ""."""
        return self.root if any(name.startswith(self.root) for name in names) else ""

    def block_prefix(self, names: Iterable[str], index: int) -> str:
        return self.prefix(names) + self.layer_prefix.format(index)


def causal_mask(
    config: PretrainedConfig,
    hidden_states: torch.Tensor,
    past_length: int,
    *,
    allow_skip: bool = True,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """The mask transformers' own model would build for `q` new tokens after `past_length` cached
    ones, in the format of config._attn_implementation (None: let sdpa use is_causal)."""
    batch_size, q_length = hidden_states.shape[:2]
    mask_function = (
        causal_mask_function
        if sliding_window is None
        else sliding_window_causal_mask_function(sliding_window)
    )
    return ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation](
        batch_size=batch_size,
        q_length=q_length,
        kv_length=past_length + q_length,
        q_offset=past_length,
        kv_offset=0,
        mask_function=mask_function,
        attention_mask=None,
        allow_is_causal_skip=allow_skip,
        local_size=sliding_window,
        dtype=hidden_states.dtype,
        config=config,
        use_vmap=False,
        device=hidden_states.device,
    )


def _positions(hidden_states: torch.Tensor, past_length: int) -> torch.Tensor:
    q_length = hidden_states.shape[1]
    return torch.arange(past_length, past_length + q_length, device=hidden_states.device)[None]


def _rotary_inputs(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, past: int
) -> dict[str, Any]:
    assert rotary is not None
    positions = _positions(hidden, past)
    window = getattr(config, "sliding_window", None)
    return {
        "attention_mask": causal_mask(config, hidden, past, sliding_window=window),
        "position_ids": positions,
        "position_embeddings": rotary(hidden, positions),
    }


def _bloom_inputs(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, past: int
) -> dict[str, Any]:
    batch_size, q_length = hidden.shape[:2]
    no_padding = torch.ones(batch_size, past + q_length, dtype=torch.long, device=hidden.device)
    return {
        "alibi": modeling_bloom.build_alibi_tensor(no_padding, config.n_head, hidden.dtype),
        "attention_mask": causal_mask(config, hidden, past),
    }


def _falcon_inputs(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, past: int
) -> dict[str, Any]:
    positions = _positions(hidden, past)
    # FalconModel always materialises the mask, so the ALiBi bias can be folded into it.
    mask = causal_mask(config, hidden, past, allow_skip=False)
    assert mask is not None
    if not config.alibi:
        assert rotary is not None
        return {
            "alibi": None,
            "attention_mask": mask,
            "position_ids": positions,
            "position_embeddings": rotary(hidden, positions),
        }
    batch_size, q_length = hidden.shape[:2]
    kv_length = past + q_length
    no_padding = torch.ones(batch_size, kv_length, dtype=torch.long, device=hidden.device)
    heads = config.num_attention_heads
    alibi = modeling_falcon.build_alibi_tensor(no_padding, heads, hidden.dtype)
    lowest = torch.finfo(hidden.dtype).min
    if mask.dtype == torch.bool:
        mask = torch.where(mask, torch.zeros((), dtype=hidden.dtype, device=mask.device), lowest)
    scale = math.sqrt(config.hidden_size // heads)
    bias = alibi.reshape(batch_size, heads, 1, kv_length) / scale
    return {
        "alibi": alibi,
        "attention_mask": torch.masked_fill(bias, mask < -1, lowest),
        "position_ids": positions,
        "position_embeddings": None,
    }


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive float mask eager attention adds to its scores."""
    lowest = torch.finfo(dtype).min
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), lowest)


def _rotary_masked(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, rows: RowMasks
) -> dict[str, Any]:
    assert rotary is not None
    return {
        "attention_mask": rows.allowed,  # sdpa takes the boolean mask as it is
        "position_ids": rows.position_ids,
        "position_embeddings": rotary(hidden, rows.position_ids),
    }


def _bloom_masked(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, rows: RowMasks
) -> dict[str, Any]:
    return {
        "alibi": modeling_bloom.build_alibi_tensor(
            rows.key_valid.long(), config.n_head, hidden.dtype
        ),
        "attention_mask": _additive(rows.allowed, hidden.dtype),
    }


def _falcon_masked(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, rows: RowMasks
) -> dict[str, Any]:
    if not config.alibi:
        assert rotary is not None
        return {
            "alibi": None,
            "attention_mask": rows.allowed,
            "position_ids": rows.position_ids,
            "position_embeddings": rotary(hidden, rows.position_ids),
        }
    batch_size, kv_length = rows.key_valid.shape
    heads = config.num_attention_heads
    alibi = modeling_falcon.build_alibi_tensor(rows.key_valid.long(), heads, hidden.dtype)
    scale = math.sqrt(config.hidden_size // heads)
    bias = alibi.reshape(batch_size, heads, 1, kv_length) / scale
    return {
        "alibi": alibi,
        "attention_mask": torch.masked_fill(bias, ~rows.allowed, torch.finfo(hidden.dtype).min),
        "position_ids": rows.position_ids,
        "position_embeddings": None,
    }


def _same_names(
    weights: dict[str, torch.Tensor], config: PretrainedConfig
) -> dict[str, torch.Tensor]:
    return weights


def _mixtral_block(
    weights: dict[str, torch.Tensor], config: PretrainedConfig
) -> dict[str, torch.Tensor]:
    """Mixtral checkpoints (hub, and save_pretrained) keep w1/w2/w3 per expert under
    block_sparse_moe; transformers' MixtralDecoderLayer runs fused expert tensors under mlp."""
    if not any(name.startswith("block_sparse_moe.") for name in weights):
        return weights
    converted = {
        name.replace("block_sparse_moe.", "mlp."): tensor
        for name, tensor in weights.items()
        if ".experts." not in name
    }

    def stacked(w: str) -> torch.Tensor:
        experts = range(config.num_local_experts)
        return torch.stack([weights[f"block_sparse_moe.experts.{e}.{w}.weight"] for e in experts])

    # MixtralExperts splits gate_up_proj in halves: gate (w1) first, then up (w3).
    converted["mlp.experts.gate_up_proj"] = torch.cat([stacked("w1"), stacked("w3")], dim=1)
    converted["mlp.experts.down_proj"] = stacked("w2")
    return converted


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _falcon_kv_heads(config: PretrainedConfig) -> int:
    if config.new_decoder_architecture:
        return config.num_attention_heads  # keys are broadcast to every head before caching
    return 1 if config.multi_query else config.num_kv_heads


def _rotary(module: Callable[[Any], nn.Module]) -> Callable[[PretrainedConfig], nn.Module | None]:
    """The model's rotary embedding module: inverse frequencies from the config, no weights."""
    return lambda config: module(config)


def _layer_norm(config: PretrainedConfig) -> nn.Module:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


LLAMA = Family(
    name="llama",
    covers="Llama 2/3, SmolLM2 and other Llama-shaped models",
    layer_class=modeling_llama.LlamaDecoderLayer,
    root="model.",
    layer_prefix="layers.{}.",
    embed="embed_tokens",
    final_norm="norm",
    lm_head="lm_head",
    embed_norm=None,
    attn_implementation="sdpa",
    cache_kwarg="cache",
    make_norm=lambda c: modeling_llama.LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps),
    make_rotary=_rotary(modeling_llama.LlamaRotaryEmbedding),
    layer_inputs=_rotary_inputs,
    masked_inputs=_rotary_masked,
    kv_width=lambda c: c.num_key_value_heads * _head_dim(c),
    convert_block=_same_names,
)

MIXTRAL = Family(
    name="mixtral",
    covers="Mixtral mixture-of-experts models",
    layer_class=modeling_mixtral.MixtralDecoderLayer,
    root="model.",
    layer_prefix="layers.{}.",
    embed="embed_tokens",
    final_norm="norm",
    lm_head="lm_head",
    embed_norm=None,
    attn_implementation="sdpa",
    cache_kwarg="cache",
    make_norm=lambda c: modeling_mixtral.MixtralRMSNorm(c.hidden_size, eps=c.rms_norm_eps),
    make_rotary=_rotary(modeling_mixtral.MixtralRotaryEmbedding),
    layer_inputs=_rotary_inputs,
    masked_inputs=_rotary_masked,
    kv_width=lambda c: c.num_key_value_heads * _head_dim(c),
    convert_block=_mixtral_block,
    experts_implementation="grouped_mm",
)

BLOOM = Family(
    name="bloom",
    covers="BLOOM models (ALiBi positions)",
    layer_class=modeling_bloom.BloomBlock,
    root="transformer.",
    layer_prefix="h.{}.",
    embed="word_embeddings",
    final_norm="ln_f",
    lm_head="lm_head",
    embed_norm="word_embeddings_layernorm",
    # BloomAttention computes its own scores and adds the mask: it needs eager's additive mask.
    attn_implementation="eager",
    cache_kwarg="layer_past",
    make_norm=_layer_norm,
    make_rotary=lambda c: None,
    layer_inputs=_bloom_inputs,
    masked_inputs=_bloom_masked,
    kv_width=lambda c: c.hidden_size,
    convert_block=_same_names,
)

FALCON = Family(
    name="falcon",
    covers="Falcon models, rotary or ALiBi (config.alibi)",
    layer_class=modeling_falcon.FalconDecoderLayer,
    root="transformer.",
    layer_prefix="h.{}.",
    embed="word_embeddings",
    final_norm="ln_f",
    lm_head="lm_head",
    embed_norm=None,
    attn_implementation="sdpa",
    cache_kwarg="layer_past",
    make_norm=_layer_norm,
    make_rotary=lambda c: None if c.alibi else _rotary(modeling_falcon.FalconRotaryEmbedding)(c),
    layer_inputs=_falcon_inputs,
    masked_inputs=_falcon_masked,
    kv_width=lambda c: _falcon_kv_heads(c) * _head_dim(c),
    convert_block=_same_names,
)

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, BLOOM, FALCON, MIXTRAL)}


def family_of(config: PretrainedConfig) -> Family:
    """The family that runs `config.model_type`; UnsupportedModelError names those there are."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = "; ".join(f"{f.name} ({f.covers})" for f in FAMILIES.values())
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported. peerd runs these families: {supported}. "
        "Use a checkpoint of one of them."
    )


def prepare_config(config: PretrainedConfig, family: Family) -> PretrainedConfig:
    """Set the kernels transformers' own model would pick: the attention kernel the family's masks
    are built for, and the experts kernel (a bare config has neither)."""
    config._attn_implementation = family.attn_implementation
    if family.experts_implementation is not None:
        config._experts_implementation = family.experts_implementation
    return config
