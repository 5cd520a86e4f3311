"""Where and how a daemon serves its blocks: the torch device, the dtype of activations, weights
and KV cache, and the weight quantization (`peerd start --device --dtype --quant`).

`auto` resolves against the machine: `--device auto` is the first CUDA GPU, else Apple's MPS,
else the CPU; `--dtype auto` is half precision where the device runs it fast (bfloat16 on a CUDA
GPU that has it, else float16, as Petals does; float16 on MPS); on a CPU, whichever of float32
and bfloat16 one block of the model decodes faster in, measured once (docs/blocks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from blocks.errors import BlocksError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
QUANTS = ("none", "int8", "nf4")
# --dtype auto on a CPU: bfloat16 only when clearly faster (it also rounds more).
AUTO_MARGIN = 0.1
GPU_RESERVE = 0.1  # of the free GPU memory, kept for activations and allocator fragmentation


class ServingError(BlocksError):
    """A --device, --dtype or --quant this machine cannot serve with; the message says why."""


@dataclass(frozen=True)
class Serving:
    """A resolved choice: a concrete device ("cpu", "cuda:0", "mps"), a dtype and a quant."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    quant: str = "none"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        """E.g. "cuda:0 bfloat16 nf4", for banners and logs."""
        quant = "" if self.quant == "none" else f" {self.quant}"
        return f"{self.device} {self.dtype_name}{quant}"


def resolve_serving(
    device: str = "cpu",
    dtype: str = "float32",
    quant: str = "none",
    checkpoint: str | Path | None = None,
) -> Serving:
    """The Serving of `peerd start`'s flags, or ServingError saying what to give instead. With a
    `checkpoint`, `--dtype auto` on a CPU is the faster of float32 and bfloat16 for its blocks
    (fastest_cpu_dtype); without one, float32."""
    resolved = resolve_device(device)
    quant = resolve_quant(quant, resolved)
    if dtype.strip().lower() == "auto" and resolved == "cpu" and checkpoint is not None:
        return Serving(resolved, fastest_cpu_dtype(checkpoint, quant), quant)
    return Serving(resolved, resolve_dtype(dtype, resolved), quant)


def fastest_cpu_dtype(checkpoint: str | Path, quant: str = "none") -> torch.dtype:
    """bfloat16 if one block of `checkpoint` decodes at least AUTO_MARGIN faster in it than in
    float32 on this CPU (CPUs with AMX or AVX-512 BF16 do; most others run it slower), else
    float32. Each figure is measured once and kept in the throughput cache."""
    from blocks.span import load_span
    from blocks.throughput import measure_throughput

    speeds = {}
    for dtype in (torch.float32, torch.bfloat16):
        span = load_span(checkpoint, 0, 1, dtype, "cpu", quant=quant)
        speeds[dtype] = measure_throughput(span).decode_tps
    faster = speeds[torch.bfloat16] >= speeds[torch.float32] * (1 + AUTO_MARGIN)
    return torch.bfloat16 if faster else torch.float32


def resolve_device(text: str) -> str:
    """auto | cpu | cuda | cuda:N | mps -> a device torch can place tensors on, checked here."""
    text = text.strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return "cuda:0"
        return "mps" if _mps_available() else "cpu"
    if text == "cpu":
        return "cpu"
    if text == "mps":
        if not _mps_available():
            raise ServingError("--device mps: this machine has no Apple MPS device; give cpu")
        return "mps"
    if text == "cuda" or text.startswith("cuda:"):
        index_text = text.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise ServingError(f"--device {text}: expected cuda or cuda:N, N a GPU index")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index_text) >= count:
            have = f"GPUs cuda:0..cuda:{count - 1}" if count else "no CUDA GPU (or a CPU torch)"
            raise ServingError(f"--device {text}: this machine has {have}; give cpu or auto")
        return f"cuda:{int(index_text)}"
    raise ServingError(f"--device {text}: expected auto, cpu, cuda, cuda:N or mps")


def resolve_dtype(text: str, device: str) -> torch.dtype:
    """auto | float32 | bfloat16 | float16 on `device` (see the module docstring for auto)."""
    text = text.strip().lower()
    if text == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device == "mps" else torch.float32
    if text not in DTYPES:
        raise ServingError(f"--dtype {text}: expected auto, {', '.join(DTYPES)}")
    return DTYPES[text]


def resolve_quant(text: str, device: str) -> str:
    """none | int8 | nf4; int8 and nf4 need bitsandbytes (docs/blocks.md says why it)."""
    text = text.strip().lower()
    if text not in QUANTS:
        raise ServingError(f"--quant {text}: expected {', '.join(QUANTS)}")
    if text != "none":
        if device == "mps":
            raise ServingError(f"--quant {text}: bitsandbytes does not run on MPS; give none")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ServingError(
                f"--quant {text} needs bitsandbytes: pip install 'bitsandbytes>=0.50'"
            ) from None
    return text


def free_memory(device: str, ram_fraction: float) -> int:
    """Bytes a server may give weights and KV cache on `device`: on a CUDA GPU what
    torch.cuda.mem_get_info reports free, less GPU_RESERVE for activations and the allocator's
    workspace; elsewhere `ram_fraction` of the free RAM (the rest stays for the OS and others)."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free * (1 - GPU_RESERVE))
    import psutil

    return int(psutil.virtual_memory().available * ram_fraction)


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())
