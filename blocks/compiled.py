"""A span's one-token decode step as one compiled graph (torch.compile, inductor), on CPU.

An eager decode step of a small model is mostly dispatch: a 10-block one-token pass of the
default model runs ~1,100 torch operations, and on the 2-core development machine (2026-12-06,
two torch threads) its 70 matrix products took 7.2-7.4 ms of its 10.8-11.9. Compiled whole, the
norms, rotary positions, cache writes and residual adds fuse into a few C++ kernels around the
same products: the same pass took 8.6-8.9 ms against 10.8-11.0 eager (outputs within float
rounding).

What is compiled is the span's own layers' lean forward (blocks.lean), called with a cache view
that writes the step's keys and values at a position the graph takes as an input. Shapes are
dynamic (the session's cache length and its max_length), so one compilation serves every session
and position; it runs once when a server loads its span (~20 s on two cores, a few with
inductor's on-disk cache warm) and needs a C++ compiler. Only spans that can run it are
compiled: CPU, unquantized, no LoRA adapters, layers of a lean family with one kind of attention.
A step runs compiled when it is one token of an unpadded single-sequence session whose cache
holds 2 or more positions and has room for 2 more, and whose layers need no mask; everything else
(prompts, merged steps of several sessions, a session's first and last step) runs eager as
before. A compiled step that would need compiling again (a guard failed) runs eager instead:
serving never stalls on a compilation.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

from blocks import lean, threads
from blocks.cache import KVCache

log = logging.getLogger(__name__)

# Failed compiled calls (each then ran eager) after which a span stops trying.
MAX_FAILURES = 3
# The warm-up's cache: positions held and room. Neither may be 0 or 1 (torch specializes those)
# nor equal to any size of the model (torch would take them for that one, fixed): primes.
WARM_LENGTH = 251
WARM_ROOM = 509


class _StepCache:
    """What a lean layer calls `cache.update` on in the graph: writes one step's keys and values
    at `length` into the session's buffers and returns the filled part."""

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int, first: int
    ) -> None:
        self.keys, self.values, self.length, self.first = keys, values, length, first

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: object, **__: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i, end = layer_idx - self.first, self.length + key.shape[-2]
        self.keys[i][:, :, self.length : end] = key
        self.values[i][:, :, self.length : end] = value
        return self.keys[i][:, :, :end], self.values[i][:, :, :end]


def unsupported(span: Any) -> str | None:
    """Why `span` (a blocks.Span) cannot run compiled decode steps here; None if it can."""
    if span.device.type != "cpu":
        return "compiled decode steps are for CPU spans"
    if span.quant != "none":
        return f"its weights are quantized ({span.quant})"
    if span.adapters:
        return "it serves LoRA adapters"
    if span.family.layer_kinds is not None or not all(
        isinstance(layer, lean._LeanForward) for layer in span.layers
    ):
        return f"{span.family.name} layers have no lean forward (blocks.lean)"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler (g++) on this machine: install one (apt install g++)"
    return None


class CompiledDecode:
    """The compiled one-token step of a span; `__call__` gives None where the step must run
    eager (see the module's docstring)."""

    def __init__(self, span: Any) -> None:
        self.layers = list(span.layers)
        self.first = span.start
        self.failures = 0
        self._step: Callable[..., torch.Tensor] = torch.compile(
            self._run, dynamic=True, fullgraph=True
        )

    def _run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        length: int,
    ) -> torch.Tensor:
        cache = _StepCache(keys, values, length, self.first)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=(cos, sin), cache=cache)
        return hidden

    def warm_up(self, hidden_size: int, rotary: Any, kv_shape: tuple[int, int]) -> float:
        """Compile now, on a scratch cache; returns the seconds it took."""
        started = time.perf_counter()
        heads, width = kv_shape
        dtype = next(self.layers[0].parameters()).dtype
        # Made in inference mode, as a session's caches are: the graph is guarded on it.
        with torch.inference_mode():
            keys = [torch.zeros(1, heads, WARM_ROOM, width, dtype=dtype) for _ in self.layers]
            values = [torch.zeros_like(k) for k in keys]
            for buffer in (*keys, *values):
                torch._dynamo.mark_dynamic(buffer, 2)  # any session's max_length
            hidden = torch.zeros(1, 1, hidden_size, dtype=dtype)
            cos, sin = rotary(hidden, torch.tensor([[WARM_LENGTH]]))
            self._step(hidden, cos, sin, keys, values, WARM_LENGTH)
        return time.perf_counter() - started

    def __call__(
        self, hidden: torch.Tensor, kv: KVCache, inputs: dict[str, Any]
    ) -> torch.Tensor | None:
        keys, values = kv.keys, kv.values
        if (
            self.failures >= MAX_FAILURES
            or hidden.shape[:2] != (1, 1)
            or kv.length < 2
            or inputs.get("attention_mask") is not None
            or any(t is None for t in keys)
            or any(t is None for t in values)
            or kv.length + 1 >= kv.max_length  # the last slot: the graph is for ones before it
        ):
            return None
        cos, sin = inputs["position_embeddings"]
        if not hidden.is_inference():  # a server's decoded input: the graph takes inference
            hidden = hidden.clone()  # tensors, as a session's caches are (it is guarded on it)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._step(hidden, cos, sin, keys, values, kv.length)
        except Exception as e:  # a guard failed (or worse): this step runs eager
            self.failures += 1
            log.warning(
                "compiled decode step failed (%s: %s); ran eager%s",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
                "" if self.failures < MAX_FAILURES else ", and every later step will",
            )
            return None


def compile_span(span: Any) -> CompiledDecode | None:
    """A CompiledDecode of `span`, compiled and warm; None (logged) where it cannot run here or
    its compilation failed."""
    why = unsupported(span)
    if why is not None:
        log.info("decode steps of blocks %d:%d run eager: %s", span.start, span.end, why)
        return None
    compiled = CompiledDecode(span)
    config = span.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    threads.apply(1)  # the kernels take the thread count of the steps they will run
    try:
        seconds = compiled.warm_up(config.hidden_size, span.rotary, (heads, width))
    except Exception as e:  # no working compiler, an unsupported op: eager it is
        log.warning(
            "decode steps of blocks %d:%d run eager: compiling them failed (%s: %s)",
            span.start,
            span.end,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None
    log.info("decode steps of blocks %d:%d compiled in %.1f s", span.start, span.end, seconds)
    return compiled
