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
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

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


class SkinnyLinear(nn.Linear):
    """An nn.Linear that computes weight @ x.T for the row counts in `skinny_rows` (inference
    only: with autograd on it is an nn.Linear)."""

    skinny_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
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
