"""How fast a span runs on this machine: tokens/s of one decode step and of a 512-token prefill,
measured once per (model, span, device, dtype, quant) and kept as JSON in the user cache."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blocks.cache import MemoryCache, SpanSession
from blocks.checkpoint import user_cache_dir
from blocks.client_side import ClientSide
from blocks.span import Span

PREFILL_TOKENS = 512
DECODE_STEPS = 16


@dataclass(frozen=True)
class Throughput:
    decode_tps: float  # single-token steps of one sequence, per second
    prefill_tps: float  # prompt tokens per second, in one 512-token prefill
    threads: int  # torch.get_num_threads() during the measurement
    measured_at: float  # time.time()


def measure_throughput(
    span: Span,
    *,
    client: ClientSide | None = None,
    use_disk_cache: bool = True,
    cache_dir: Path | None = None,
) -> Throughput:
    """Decode and prefill tokens/s of `span` (plus embeddings and LM head when `client` is given,
    i.e. a whole local model when the span covers every block).

    With use_disk_cache, a figure measured earlier for the same model, span, device, dtype,
    quantization and thread count is returned instead of measuring again; a new one is stored.
    """
    path = _record_path(span, client, cache_dir or user_cache_dir() / "throughput")
    threads = torch.get_num_threads()
    if use_disk_cache and (cached := _read_record(path)) is not None and cached.threads == threads:
        return cached
    step = _step_function(span, client)
    cache = MemoryCache(budget_tokens=2 * (PREFILL_TOKENS + DECODE_STEPS + 8))
    # Warm-up: the first calls allocate and pick kernels.
    with cache.open_session(1, PREFILL_TOKENS) as session:
        step(32, session)
        step(1, session)
    with cache.open_session(1, PREFILL_TOKENS) as session:
        started = _clock(span.device)
        step(PREFILL_TOKENS, session)
        prefill_tps = PREFILL_TOKENS / (_clock(span.device) - started)
    with cache.open_session(1, DECODE_STEPS + 8) as session:
        step(4, session)
        step(1, session)
        started = _clock(span.device)
        for _ in range(DECODE_STEPS):
            step(1, session)
        decode_tps = DECODE_STEPS / (_clock(span.device) - started)
    result = Throughput(decode_tps, prefill_tps, threads, time.time())
    if use_disk_cache:
        _write_record(path, result)
    return result


def _clock(device: torch.device) -> float:
    """Seconds, once the device has finished the work queued so far (GPU kernels run async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _step_function(span: Span, client: ClientSide | None) -> Callable[[int, SpanSession], None]:
    """One forward of `n` new tokens in a session: random hidden states through the span, or
    random token ids through embeddings, span and LM head (last position, as generation does)."""
    hidden_size = span.config.hidden_size

    def through_span(n: int, session: SpanSession) -> None:
        span(torch.randn(1, n, hidden_size, dtype=span.dtype, device=span.device), session)

    def through_model(n: int, session: SpanSession) -> None:
        assert client is not None
        ids = torch.randint(0, span.config.vocab_size, (1, n), device=span.device)
        with torch.inference_mode():
            hidden = span(client.embed(ids), session)
            client.logits(hidden[:, -1:])

    return through_span if client is None else through_model


def _record_path(span: Span, client: ClientSide | None, cache_dir: Path) -> Path:
    what = "model" if client is not None else "span"
    key = f"{span.model}_{what}_{span.start}-{span.end}_{span.device}_{span.dtype}_{span.quant}"
    if span.compiled is not None:  # its passes run compiled (blocks.compiled)
        key += "_compiled"
    return cache_dir / (re.sub(r"[^A-Za-z0-9._-]+", "-", key) + ".json")


def _read_record(path: Path) -> Throughput | None:
    try:
        return Throughput(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # absent or unreadable: measure again


def _write_record(path: Path, result: Throughput) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(f".tmp-{os.getpid()}")
    temp.write_text(json.dumps(asdict(result)))
    os.replace(temp, path)  # atomic: a concurrent reader sees the old record or the new one
