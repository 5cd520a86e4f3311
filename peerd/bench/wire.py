"""`peerd bench wire`: encode+decode throughput, wire size and error of every tensor codec, beside
`torch.clone` of the same tensor in the same run.

The path timed is the one hidden states take between peers: a Step message is encoded to frame
bytes (`wire.encode_message`), fed to a `wire.MessageDecoder` and decoded back to a tensor. Two
tensors: a prefill (1x2048x4096 fp32, 32 MiB, where bandwidth matters) and a decode step
(1x1x576 fp32, one token of the default model, where per-message overhead matters). Times are the
best of `repeats`. torch.clone is timed right before each round of each codec, and a codec's
`ratio_to_clone` is its time against the best clone of its own rounds (why: `_ALLOCATOR_NOTE`);
each codec entry carries that `clone_gbps`, and the section's `clone_gbps` is the best seen. GB/s
counts the raw tensor's bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import wire

PREFILL_SHAPE = (1, 2048, 4096)
DECODE_STEP_SHAPE = (1, 1, 576)
MIN_BATCH_SECONDS = 0.005
"""Tiny tensors are timed in batches of calls lasting at least this long (timer resolution)."""


def run_wire_bench(repeats: int = 5) -> dict[str, Any]:
    """Measure every codec on a prefill and a decode-step tensor; see the module docstring.

    The prefill results are at the top level (`clone_gbps`, `codecs`), the decode step's under
    `decode_step` in the same shape.
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    generator = torch.Generator().manual_seed(0)
    prefill = torch.randn(PREFILL_SHAPE, generator=generator)
    decode_step = torch.randn(DECODE_STEP_SHAPE, generator=generator)
    report = _bench_tensor(prefill, repeats)
    report["decode_step"] = _bench_tensor(decode_step, repeats)
    report["repeats"] = repeats
    report["torch_threads"] = torch.get_num_threads()
    report["path"] = "encode_message(Step) -> frame bytes -> MessageDecoder -> tensor"
    return report


def _bench_tensor(tensor: torch.Tensor, repeats: int) -> dict[str, Any]:
    size = tensor.numel() * tensor.element_size()
    codecs: dict[str, dict[str, float]] = {}
    for name in wire.COMPRESSIONS:
        round_trip = _round_trip(tensor, name)
        frame_size, decoded = round_trip()  # warm up, and measure size and error once
        error = wire.max_abs_error(tensor, decoded)
        del decoded  # nothing large stays alive while timing (see _ALLOCATOR_NOTE)
        batch = _batch_size(round_trip)
        best = clone_best = float("inf")
        for _ in range(repeats):
            clone_best = min(clone_best, _time(lambda: tensor.clone(), batch))
            best = min(best, _time(round_trip, batch))
        codecs[name] = {
            "gbps": size / best / 1e9,
            "ratio_to_clone": clone_best / best,
            "size_ratio": frame_size / size,
            "max_abs_error": error,
            "seconds": best,
            "wire_bytes": frame_size,
            "clone_gbps": size / clone_best / 1e9,
        }
    return {
        "tensor": {"shape": list(tensor.shape), "dtype": "float32", "bytes": size},
        "clone_gbps": max(result["clone_gbps"] for result in codecs.values()),
        "codecs": codecs,
    }


_ALLOCATOR_NOTE = """\
Why each codec is compared with the clones timed in its own rounds: glibc serves a 32 MiB
allocation either from fresh pages (8192 page faults: clone runs at ~3-5 GB/s here) or, after some
mid-sized buffers were freed (lz4's outputs do this), from heap memory it kept (no faults: clone at
~15-20 GB/s). Every path that allocates its output, clone and the codecs alike, swings with it, so
a codec is set against the clone that ran under the same conditions, right before it."""


def _round_trip(tensor: torch.Tensor, compression: str) -> Callable[[], tuple[int, torch.Tensor]]:
    message = wire.Step(session_id="bench", step_id=1, hidden_states=tensor)

    def round_trip() -> tuple[int, torch.Tensor]:
        frame = wire.encode_message(message, compression)
        decoder = wire.MessageDecoder(expect=wire.Step)
        decoder.receive_data(frame)
        decoded = decoder.next_message()
        assert isinstance(decoded, wire.Step)
        return len(frame), decoded.hidden_states

    return round_trip


def _batch_size(call: Callable[[], object]) -> int:
    started = time.perf_counter()
    call()
    once = time.perf_counter() - started
    return max(1, int(MIN_BATCH_SECONDS / max(once, 1e-9)))


def _time(call: Callable[[], object], batch: int) -> float:
    """Seconds per call, averaged over one batch."""
    started = time.perf_counter()
    for _ in range(batch):
        call()
    return (time.perf_counter() - started) / batch


def format_wire_report(report: dict[str, Any]) -> str:
    """The report as two readable tables (prefill, then decode step)."""
    lines = [
        f"peerd bench wire: {report['path']}; best of {report['repeats']}, "
        f"{report['torch_threads']} torch threads"
    ]
    sections = (("prefill", report), ("decode step", report["decode_step"]))
    for title, section in sections:
        tensor = section["tensor"]
        shape = "x".join(str(size) for size in tensor["shape"])
        lines += [
            "",
            f"{title}: {tensor['dtype']} {shape} ({_human_bytes(tensor['bytes'])}); "
            f"best torch.clone {section['clone_gbps']:.2f} GB/s",
            f"  {'codec':<20} {'GB/s':>8} {'clone GB/s':>11} {'x clone':>8} {'size':>7} "
            f"{'max abs error':>14}",
        ]
        for name, result in section["codecs"].items():
            lines.append(
                f"  {name:<20} {result['gbps']:>8.3f} {result['clone_gbps']:>11.3f} "
                f"{result['ratio_to_clone']:>8.3f} {result['size_ratio']:>7.3f} "
                f"{result['max_abs_error']:>14.3g}"
            )
    lines += [
        "",
        "GB/s: raw tensor bytes through encode+decode; clone GB/s: torch.clone of the same "
        "tensor in the same rounds; x clone: their ratio; size: frame bytes over tensor bytes.",
    ]
    return "\n".join(lines)


def _human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
