"""A span's passes as compiled graphs (torch.compile, inductor), on CPU: a session's one-token
decode steps, the first pass of its prompt, prompts after a past (a long prompt's later chunks,
a chat's next turn), and merged decode steps of a few sessions.

An eager decode step of a small model is mostly dispatch: a 10-block one-token pass of the
default model runs ~1,100 torch operations, and on the 2-core development machine (2026-12-06,
Intel Xeon, two torch threads) its 70 matrix products took 7.2-7.4 ms of its 10.8-11.9. Compiled
whole, the norms, rotary positions, attention, cache writes and residual adds fuse into a few C++
kernels around the products: the step took 8.6-8.9 ms against 10.8-11.0 eager, and an 84-token
prompt 39-41 ms against 44-49 (outputs within float rounding). The decode steps' graph also
freezes the weights into itself and picks each product's kernel by timing (STEP_OPTIONS): on the
same machine's AMD EPYC successor, with torch's BLAS calls the compiled step was slower than
eager (10.5 against 9.4 ms), with the picked kernels faster (6.8-7.7 against 8.6-9.5 ms).
Merged decode steps of 2-4 sessions run in a fourth graph, one layer's pass that every layer of
the span runs (their weights are its inputs): on the EPYC a 4-row pass of 10 blocks took ~18 ms
against ~22 eager, and it compiles in seconds, where a whole span's merged graph took 60-160 s
(docs/blocks.md#compiled-passes).

What is compiled is the span's own layers' lean forward (blocks.lean), called with a cache view
that writes the pass's keys and values at a position the graph takes as an input. Shapes are
dynamic (the session's cache length and its max_length, the prompt's length), so one compilation
of each graph serves every session and position; they compile when a server loads its span
(10-30 s on two cores, less with inductor's on-disk cache warm) and need a C++ compiler. Only
spans that can run them are compiled: CPU, unquantized, no LoRA adapters, layers of a lean family
with one kind of attention. A pass of a single-sequence session runs compiled when it is one
token with 2 or more positions cached and needs no mask, or a prompt of at least
blocks.threads.PREFILL_ROWS tokens: from position 0 in the prompts' graph, after a past (a long
prompt's later chunks, a chat's next turn) in the chunks' graph, which builds the causal mask
itself; and it leaves the cache room for 1 more. Merged one-token steps of 2-4 single-sequence
sessions, each with 2 or more positions cached and short of its last slot, run in the merged
steps' graph, which writes each row into its own session's buffers and builds each row's mask.
Everything else (merged steps of more sessions or of prompts, padded sessions, short prompts, a
sliding window that binds, the last slot) runs eager as before. A pass
that would need compiling again (a guard failed) runs eager instead: serving never stalls on a
compilation.
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from blocks import lean, threads
from blocks.cache import KVCache, write_step

log = logging.getLogger(__name__)

# Failed compiled calls (each then ran eager) after which a span stops trying.
MAX_FAILURES = 3
# The warm-up's cache: positions held, room, and the prompt's tokens. None may be 0 or 1 (torch
# specializes those) nor equal to any size of the model (torch would take them for that one,
# fixed), nor the prompt fewer than a prefill's rows (blocks.threads): primes.
WARM_LENGTH = 251
WARM_ROOM = 509
WARM_PROMPT = 83
# The graphs, in the order they compile (the first is the one a span needs to run compiled).
KINDS = ("decode steps", "prompts", "chunks", "merged steps")
# Merged decode steps of 2 to this many sessions (one token each) run in the merged steps' graph,
# fewer rows filled up with scratch rows (zeros, each with a small cache of its own): one graph,
# not one per row count.
MERGED_ROWS = 4
# The warm-up's merged rows: positions held and room per row, primes distinct from each other
# and from the single session's (so torch takes none of them for another, fixed).
WARM_MERGED = ((241, 503), (239, 499), (233, 491), (229, 487))
# A scratch row's cache: its room and the position it writes (its output is dropped).
SCRATCH_ROOM = 7
SCRATCH_AT = 3
# Inductor's options for the decode steps' graph: the weights frozen into it as constants, and
# each matrix product's kernel picked by timing inductor's own C++ template against torch's
# BLAS call when it compiles (autotuning, not reported on stderr). A one-row product is
# memory-bound: on the 2-core development machine (AMD EPYC, 2026-12-06, two torch threads) a
# 10-block step took 6.8-7.7 ms against 8.6-9.5 eager and 10.5 compiled with torch's BLAS
# calls. Prompts' products are large enough for BLAS: their graph keeps inductor's defaults.
STEP_OPTIONS: dict[str, Any] = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
}


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
        i = layer_idx - self.first
        return write_step(self.keys[i], self.values[i], key, value, self.length)


class _MergedCache:
    """`cache.update` for the merged steps' graph (one layer's pass): each row's one step
    written into its own session's buffers of this layer, and every row's keys and values
    returned padded to `width` (the mask hides the padding; no row ends at `width`, so the
    graph never depends on which row is the longest)."""

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int], width: int
    ) -> None:
        self.keys, self.values, self.lengths, self.width = keys, values, lengths, width

    def update(
        self, key: torch.Tensor, value: torch.Tensor, *_: object, **__: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        padded_keys, padded_values = [], []
        for row, length in enumerate(self.lengths):
            keys, values = write_step(
                self.keys[row], self.values[row], key[row : row + 1], value[row : row + 1], length
            )
            pad = (0, 0, 0, self.width - length - 1)
            padded_keys.append(torch.nn.functional.pad(keys, pad))
            padded_values.append(torch.nn.functional.pad(values, pad))
        return torch.cat(padded_keys), torch.cat(padded_values)


def kv_shape(config: Any) -> tuple[int, int]:
    """(key heads, head width) of a Llama-shaped model's layers."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(heads), int(width)


def unsupported(span: Any) -> str | None:
    """Why `span` (a blocks.Span) cannot run compiled passes here; None if it can."""
    if span.device.type != "cpu":
        return "compiled passes are for CPU spans"
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


class CompiledPasses:
    """A span's compiled passes (a session's one-token steps, its prompt's first pass, prompts
    after a past, merged steps: `run_merged`):
    `__call__` runs one, or gives None where it must run eager (see the module's docstring)."""

    def __init__(self, span: Any) -> None:
        self.layers = list(span.layers)
        self.first = span.start
        self.kv_heads, self.head_dim = kv_shape(span.config)
        self.rotary = span.rotary
        # The layers' sliding window (Mistral's), if any: a chunk that reaches past it needs a
        # narrower mask than the causal one the chunks' graph builds, and runs eager.
        self.window: int | None = getattr(span.config, "sliding_window", None)
        self.prompts = False  # whether the prompts' graph compiled (warm_up)
        self.chunks = False  # whether the chunks' graph compiled (warm_up)
        self.merged_steps = False  # whether the merged steps' graph compiled (warm_up)
        self.failures = 0
        self._scratch: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        # torch keeps compiled graphs with the code they came from, at most 8 per code object
        # (torch._dynamo.config.recompile_limit): with a code object of its own, each of a
        # span's graphs is its own and goes with it (a server that moves compiles its new span;
        # a process may hold several).
        self._step: Callable[..., torch.Tensor] = self._compiled(STEP_OPTIONS)
        self._prompt: Callable[..., torch.Tensor] = self._compiled({})
        self._chunk: Callable[..., torch.Tensor] = functools.partial(
            self._compiled({}), masked=True
        )
        # One layer's pass, the same graph for every layer (their weights are its inputs, not
        # constants): it compiles in seconds, where the span's whole merged pass took 60-125 s.
        self._merged: Callable[..., torch.Tensor] = self._compiled({}, type(self)._merged_layer)

    def _compiled(
        self, options: dict[str, Any], method: Callable[..., torch.Tensor] | None = None
    ) -> Callable[..., torch.Tensor]:
        """`method` (`_run`) under a code object of its own, compiled with inductor's
        `options`."""
        method = method or type(self)._run
        run = types.FunctionType(
            method.__code__.replace(), globals(), method.__name__, method.__defaults__, None
        ).__get__(self)
        return torch.compile(run, dynamic=True, fullgraph=True, options=options)

    def _run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        length: int,
        masked: bool = False,
    ) -> torch.Tensor:
        """The layers on `hidden`, its keys and values written into the buffers at `length`.
        `masked` (the chunks' graph): tokens after `length` cached ones, each attending to the
        cache, to itself and to the tokens before it (the causal mask transformers builds, made
        in the graph); else one token, or a prompt from position 0, which need no mask."""
        mask = None
        if masked:
            tokens = hidden.shape[1]
            seen = torch.arange(length + tokens, device=hidden.device)
            at = torch.arange(tokens, device=hidden.device) + length
            mask = (seen[None, :] <= at[:, None])[None, None]
        cache = _StepCache(keys, values, length, self.first)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), cache=cache)
        return hidden

    def _merged_layer(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        lengths: list[int],
        width: int,
    ) -> torch.Tensor:
        """`layer` on `hidden` [rows, 1, hidden]: row r one step of its own session, whose
        buffers of this layer are keys[r] and values[r], after lengths[r] cached positions."""
        cache = _MergedCache(keys, values, lengths, width)
        return layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), cache=cache)

    def _run_merged(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kvs: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
        lengths: list[int],
    ) -> torch.Tensor:
        """The layers on merged rows, layer by layer in the merged steps' graph; each row
        attends to its own cache and itself (the mask hides the rest)."""
        width = max(lengths) + 2
        limits = torch.tensor(lengths, device=hidden.device)
        seen = torch.arange(width, device=hidden.device)
        mask = (seen[None, :] <= limits[:, None])[:, None, None, :]
        for i, layer in enumerate(self.layers):
            keys, values = [k[i] for k, _ in kvs], [v[i] for _, v in kvs]
            hidden = self._merged(layer, hidden, cos, sin, mask, keys, values, lengths, width)
        return hidden

    def warm_up(self, hidden_size: int, kind: str) -> float:
        """Compile the graph of a kind of pass (KINDS) now, on a scratch cache, with the thread
        count its passes run with (the kernels keep it); returns the seconds it took."""
        started = time.perf_counter()
        dtype = next(self.layers[0].parameters()).dtype
        if kind == "merged steps":
            self._warm_up_merged(hidden_size, dtype)
            return time.perf_counter() - started
        prompt = kind != "decode steps"  # a prompt from position 0, or a chunk after a past
        length = 0 if kind == "prompts" else WARM_LENGTH
        tokens = WARM_PROMPT if prompt else 1
        threads.apply(tokens)
        # Made in inference mode, as a session's caches are: the graph is guarded on it.
        with torch.inference_mode():
            keys, values = self._buffers(WARM_ROOM, dtype, dynamic=True)
            hidden = torch.zeros(1, tokens, hidden_size, dtype=dtype)
            if prompt:
                torch._dynamo.mark_dynamic(hidden, 1)  # any prompt's length
            cos, sin = self.rotary(hidden, torch.arange(length, length + tokens)[None])
            graph = {"prompts": self._prompt, "chunks": self._chunk}.get(kind, self._step)
            graph(hidden, cos, sin, keys, values, length)
        self.prompts = self.prompts or kind == "prompts"
        self.chunks = self.chunks or kind == "chunks"
        return time.perf_counter() - started

    def _buffers(
        self,
        room: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        dynamic: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A session's key and value buffers (zeros) for this span's layers, `room` positions;
        `dynamic` (a warm-up's): a graph compiled on them takes any session's room."""
        shape = (1, self.kv_heads, room, self.head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        values = [torch.zeros_like(k) for k in keys]
        if dynamic:
            for buffer in (*keys, *values):
                torch._dynamo.mark_dynamic(buffer, 2)
        return keys, values

    def _warm_up_merged(self, hidden_size: int, dtype: torch.dtype) -> None:
        threads.apply(MERGED_ROWS)
        with torch.inference_mode():
            kvs = [self._buffers(room, dtype, dynamic=True) for _, room in WARM_MERGED]
            lengths = [length for length, _ in WARM_MERGED]
            hidden = torch.zeros(MERGED_ROWS, 1, hidden_size, dtype=dtype)
            cos, sin = self.rotary(hidden, torch.tensor(lengths)[:, None])
            self._run_merged(hidden, cos, sin, kvs, lengths)
        self.merged_steps = True

    def run_merged(
        self, hidden: torch.Tensor, kvs: list[KVCache], positions: torch.Tensor
    ) -> torch.Tensor | None:
        """Merged one-token steps of 2..MERGED_ROWS sessions (row r of `hidden` continues
        kvs[r], at positions[r, 0]) in the merged steps' graph, or None where they must run
        eager: a row with fewer than 2 positions cached or at its last slot, a sliding window
        that binds, more rows."""
        rows = hidden.shape[0]
        lengths = [kv.length for kv in kvs]
        if (
            not self.merged_steps
            or self.failures >= MAX_FAILURES
            or not 2 <= rows <= MERGED_ROWS
            or hidden.shape[1] != 1
            or len(kvs) != rows
            or any(kv.length < 2 or kv.length + 1 >= kv.max_length for kv in kvs)
            or any(t is None for kv in kvs for t in (*kv.keys, *kv.values))
            or (self.window is not None and max(lengths) + 1 > self.window)
        ):
            return None
        while len(self._scratch) < MERGED_ROWS - 2:
            self._scratch.append(self._buffers(SCRATCH_ROOM, hidden.dtype, hidden.device))
        buffers = [(kv.keys, kv.values) for kv in kvs] + self._scratch[: MERGED_ROWS - rows]
        lengths += [SCRATCH_AT] * (MERGED_ROWS - rows)
        cos, sin = self.rotary(hidden, positions)
        if rows < MERGED_ROWS:
            filler = MERGED_ROWS - rows
            hidden = torch.cat([hidden, hidden.new_zeros(filler, *hidden.shape[1:])])
            cos = torch.cat([cos, cos[-1:].expand(filler, *cos.shape[1:])])
            sin = torch.cat([sin, sin[-1:].expand(filler, *sin.shape[1:])])
        # A failed layer leaves the rows' caches written up to it at their lengths, which the
        # eager pass then writes again.
        output = self._call(self._run_merged, hidden, cos, sin, buffers, lengths)
        return None if output is None else output[:rows]

    def __call__(
        self, hidden: torch.Tensor, kv: KVCache, inputs: dict[str, Any]
    ) -> torch.Tensor | None:
        keys, values = kv.keys, kv.values
        tokens = hidden.shape[1]
        cached = kv.length >= 2 and all(t is not None for t in (*keys, *values))
        step = tokens == 1 and cached and inputs.get("attention_mask") is None
        long = tokens >= threads.PREFILL_ROWS
        prompt = self.prompts and long and kv.length == 0 and inputs.get("attention_mask") is None
        # After a past, the mask transformers builds for a single unpadded sequence is the causal
        # one (the chunks' graph builds it), unless a sliding window narrows it.
        unwindowed = self.window is None or kv.length + tokens <= self.window
        chunk = self.chunks and long and cached and unwindowed
        if (
            self.failures >= MAX_FAILURES
            or hidden.shape[0] != 1
            or not (step or prompt or chunk)
            or kv.length + tokens >= kv.max_length  # the last slot: the graphs are for before it
        ):
            return None
        if prompt:  # the session's first pass: its caches are made here, as the layers would
            shape = (1, self.kv_heads, kv.max_length, self.head_dim)
            keys[:] = [hidden.new_zeros(shape) for _ in keys]
            values[:] = [hidden.new_zeros(shape) for _ in values]
        cos, sin = inputs["position_embeddings"]
        # The graphs take inference tensors, as a session's caches are, and dense ones (they are
        # guarded on both): a server's decoded input is neither, a long prompt's chunk not dense.
        if not hidden.is_inference() or not hidden.is_contiguous():
            hidden = hidden.clone(memory_format=torch.contiguous_format)
        graph = self._step if step else self._prompt if prompt else self._chunk
        return self._call(graph, hidden, cos, sin, keys, values, kv.length)

    def _call(self, graph: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor | None:
        """`graph` on `args`, or None (logged, counted) where a guard failed (or worse): the
        pass then runs eager."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return graph(*args)
        except Exception as e:
            self.failures += 1
            log.warning(
                "a compiled pass failed (%s: %s); it ran eager%s",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
                "" if self.failures < MAX_FAILURES else ", and every later one will",
            )
            return None


def compile_span(span: Any) -> CompiledPasses | None:
    """A CompiledPasses of `span`, its graphs compiled and warm; None (logged) where it cannot
    run here or its decode steps' graph failed to compile (a prompts' or chunks' graph that fails
    leaves those passes eager)."""
    where = f"blocks {span.start}:{span.end}"
    why = unsupported(span)
    if why is not None:
        log.info("passes of %s run eager: %s", where, why)
        return None
    compiled = CompiledPasses(span)
    seconds: dict[str, float] = {}
    for kind in KINDS:
        try:
            seconds[kind] = compiled.warm_up(span.config.hidden_size, kind)
        except Exception as e:  # no working compiler, an unsupported op: eager it is
            first_line = str(e).splitlines()[0] if str(e) else ""
            log.warning(
                "%s of %s run eager: compiling them failed (%s: %s)",
                kind,
                where,
                type(e).__name__,
                first_line,
            )
            if kind == KINDS[0]:
                return None
    log.info(
        "passes of %s compiled in %.1f s (%s)",
        where,
        sum(seconds.values()),
        ", ".join(f"{kind} {s:.1f} s" for kind, s in seconds.items()),
    )
    return compiled
