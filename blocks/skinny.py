"""A span's linear layers given a few rows (one decode step, or a few merged ones) in the form the
CPU's BLAS streams their weights fastest.

A decode step multiplies a handful of rows by every weight matrix of its blocks, so the product
is bound by reading the weights from memory. nn.Linear asks for rows @ weight.T; on the
development machine (AMD EPYC, torch's MKL) that takes a slow path for 1-4 rows, while
weight @ rows.T with at least two columns streams the matrix at memory speed (one row is doubled
into two columns: a single column takes the slow path again). The linear layers of 10 blocks of
the default model, one thread: one row 14.1 ms as nn.Linear, 8.6 ms doubled; a whole forward of
2 merged decode steps took 22-23 ms as nn.Linear and 12.5 ms in the skinny form (3 rows 25-26 ->
18 ms, 4 rows 21 -> 17.5 ms; 8 rows about 23 ms either way). Both forms compute the same sums in
another order (float rounding apart: a lone session's step is no longer bit for bit what
transformers computes, as a merged step never was), and which is faster depends on the CPU and
its BLAS, so `tune` times both on the span's own weights and keeps the skinny form only for the
row counts where it is clearly faster.

Merged decode steps of 5-15 sessions (PACKED_ROWS) have a third form: oneDNN's linear with a
copy of the weight packed into its own layout (what inductor's frozen graphs call). On the same
machine, two threads, 10 blocks of the default model: a merged step of 8 sessions took 21-22 ms
against 35-39 ms with nn.Linear, 5 sessions 15-17 against 28-29 ms, 12 sessions 29-30 against
40-46 ms. The copy costs the linear weights' memory again (135 MiB for those 10 blocks), so
it is a server's choice, not load_span's: `tune_packed` (run by Span.compile_passes, which
`peerd start --compile` calls) makes it only with twice that memory free and within what the
server's memory budget leaves beside its blocks and their cache, and keeps it only where a pass
of 8 rows is clearly faster with it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import psutil
import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ROWS = (1, 2, 3, 4)
# The skinny form is kept for a row count where its time over nn.Linear's (pass by pass, the
# median) is at most this: a clear gain, not the noise of a busy machine.
CLEARLY_FASTER = 0.9
TUNE_REPS = 9
TUNE_WARM = 3
# Rounds over every row count, the best of each kept: a daemon's first second or so (its own
# start-up, the swarm answering it) made the first round find 0.98-1.07 where steady state is
# 0.74-0.78 for one row.
TUNE_ROUNDS = 2
# Blocks timed: 6 blocks of the default model are 84 MB of weights.
TUNE_BLOCKS = 6
# Merged decode steps of this many rows may run with a packed copy of each weight (oneDNN's
# layout, the kernel inductor's frozen graphs call), timed at PACKED_TUNE_ROWS rows.
PACKED_ROWS = range(5, 16)
PACKED_TUNE_ROWS = 8


class SkinnyLinear(nn.Linear):
    """An nn.Linear that computes weight @ x.T for the row counts in `skinny_rows`, and with
    oneDNN's packed copy of its weight (`packed`, if any) for PACKED_ROWS (inference only: with
    autograd on it is an nn.Linear)."""

    skinny_rows: frozenset[int] = frozenset()
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        if (
            self.packed is not None
            and not torch.compiler.is_compiling()  # (the graphs pick their own kernels)
            and PACKED_ROWS[0] <= rows <= PACKED_ROWS[-1]
            and not torch.is_grad_enabled()
        ):
            out = torch.ops.mkldnn._linear_pointwise(
                x.reshape(rows, width), self.packed, self.bias, "none", [], ""
            )
            return out.view(*x.shape[:-1], self.out_features)
        # `rows > ROWS[-1]` first: a compiled prompt's graph (blocks.compiled), whose rows are
        # any count, then never asks the set, which would fix them to one count.
        if rows > ROWS[-1] or rows not in self.skinny_rows or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        out = columns_product(self.weight, x.reshape(rows, width))
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().view(*x.shape[:-1], self.out_features)


def columns_product(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows [n, in] -> rows @ weight.T [n, out], computed as weight @ rows.T with at least two
    columns: a lone row is doubled, since one column takes the slow path again (the client's LM
    head uses it too)."""
    if rows.shape[0] == 1:
        return (weight @ rows.expand(2, rows.shape[1]).contiguous().T).T[:1]
    return (weight @ rows.T).T


def make_skinny(module: nn.Module) -> list[SkinnyLinear]:
    """Turn every plain nn.Linear under `module` into a SkinnyLinear (same parameters, skinny for
    no row count yet); return them."""
    found = [m for m in module.modules() if type(m) is nn.Linear]
    for linear in found:
        linear.__class__ = SkinnyLinear
    return found  # type: ignore[return-value]


def packable() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def set_packed(linears: list[SkinnyLinear], on: bool) -> None:
    """Give each of `linears` a packed copy of its weight (`on`), or drop it."""
    for linear in linears:
        linear.packed = (
            torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_TUNE_ROWS)
            if on and linear.weight.dtype == torch.float32
            else None
        )


def set_rows(linears: list[SkinnyLinear], rows: frozenset[int]) -> None:
    """Compute passes of `rows` rows in skinny form in every one of `linears`."""
    for linear in linears:
        linear.skinny_rows = rows


def time_ratio(
    first: Callable[[], object],
    second: Callable[[], object],
    timer: Callable[[], float] = time.thread_time,
    warm: int = TUNE_WARM,
    reps: int = TUNE_REPS,
) -> float:
    """The median over `reps` of first()'s time over second()'s, each pass of `first` timed
    right before one of `second` (a neighbour's burst of work falls on both alike), after `warm`
    untimed passes of each (first passes run slow: page faults). `timer`: the calling thread's
    CPU time by default (see tune)."""

    def timed(fn: Callable[[], object]) -> float:
        started = timer()
        fn()
        return timer() - started

    for _ in range(warm):
        first()
        second()
    return statistics.median(timed(first) / max(timed(second), 1e-9) for _ in range(reps))


def tune(
    forward: Callable[[torch.Tensor], object],
    hidden_size: int,
    linears: list[SkinnyLinear],
    timer: Callable[[], float] = time.thread_time,
) -> frozenset[int]:
    """Time `forward` (a pass through blocks whose weights come from memory, as they do when
    serving) on 1-4 rows of one token, with and without the skinny form; set and return the
    row counts where the skinny form is clearly faster in the better of TUNE_ROUNDS rounds.

    The time is the calling thread's CPU time: a daemon loads its span in a worker thread while
    its event loop meets the swarm, and wall time counted the loop's turns with the GIL (three
    daemons on two cores: the third found the forms equal, 0.99, where alone it finds 0.73)."""
    if not linears:
        return frozenset()

    def run(x: torch.Tensor, rows: frozenset[int]) -> Callable[[], object]:
        def one_pass() -> object:
            set_rows(linears, rows)
            return forward(x)

        return one_pass

    best: dict[int, float] = {}
    with torch.inference_mode():
        for _ in range(TUNE_ROUNDS):
            for rows in ROWS:
                x = torch.randn(rows, 1, hidden_size)
                ratio = time_ratio(run(x, frozenset({rows})), run(x, frozenset()), timer)
                best[rows] = min(best.get(rows, float("inf")), ratio)
    chosen = frozenset(rows for rows, ratio in best.items() if ratio <= CLEARLY_FASTER)
    set_rows(linears, chosen)
    log.info(
        "passes of %s rows in skinny form (its time over nn.Linear's by rows: %s)",
        ",".join(map(str, sorted(chosen))) or "no",
        ", ".join(f"{rows}: {ratio:.2f}" for rows, ratio in best.items()),
    )
    return chosen


def tune_packed(
    forward: Callable[[torch.Tensor], object],
    hidden_size: int,
    linears: list[SkinnyLinear],
    timer: Callable[[], float] = time.thread_time,
    room: int | None = None,
) -> bool:
    """Keep packed copies of the weights for merged steps (PACKED_ROWS) if a pass of
    PACKED_TUNE_ROWS rows through `forward` is clearly faster with them, in the better of
    TUNE_ROUNDS rounds, where oneDNN is there and memory allows; True if it kept them.
    `room`: bytes the server's memory budget leaves beside its weights and cache (None: it set
    none), which the copies must fit in."""
    if not linears or not packable():
        return False
    size = sum(linear.weight.nbytes for linear in linears)
    if room is not None and size > room:
        log.info(
            "merged passes without packed weights: they need %d MiB, the memory budget leaves "
            "%d MiB beside the blocks and their cache (raise --memory-budget for them)",
            size // 2**20,
            max(room, 0) // 2**20,
        )
        return False
    free = psutil.virtual_memory().available
    if free < 2 * size:  # the copies, and as much again to spare (see docs/blocks.md)
        log.info("merged passes without packed weights: %d MiB free", free // 2**20)
        return False
    set_packed(linears, True)
    packs = [linear.packed for linear in linears]

    def run(x: torch.Tensor, on: bool) -> Callable[[], object]:
        def one_pass() -> object:
            for linear, pack in zip(linears, packs, strict=True):
                linear.packed = pack if on else None
            return forward(x)

        return one_pass

    with torch.inference_mode():
        x = torch.randn(PACKED_TUNE_ROWS, 1, hidden_size)
        ratio = min(time_ratio(run(x, True), run(x, False), timer) for _ in range(TUNE_ROUNDS))
    keep = ratio <= CLEARLY_FASTER
    for linear, pack in zip(linears, packs, strict=True):
        linear.packed = pack if keep else None
    extra = size / 2**20 if keep else 0
    log.info(
        "merged passes of %d-%d rows %s oneDNN's packed weights (their time over nn.Linear's "
        "at %d rows: %.2f; %.0f MiB more memory)",
        PACKED_ROWS[0],
        PACKED_ROWS[-1],
        "with" if keep else "without",
        PACKED_TUNE_ROWS,
        ratio,
        extra,
    )
    return keep
