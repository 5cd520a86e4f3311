"""A span's linear layers given a few rows (a few merged decode steps) in the form the CPU's BLAS
streams their weights fastest.

A decode step multiplies a handful of rows by every weight matrix of its blocks, so the product
is bound by reading the weights from memory. nn.Linear asks for rows @ weight.T; on the
development machine (AMD EPYC, torch's MKL) that takes a slow path for 2-4 rows, while
weight @ rows.T streams the matrix at memory speed: a forward of 2 merged decode steps through
10 blocks of the default model took 22-23 ms as nn.Linear and 12.5 ms in the skinny form (3 rows
25-26 -> 18 ms, 4 rows 21 -> 17.5 ms; one row 15 ms, 8 rows about 23 ms either way). Both forms
compute the same sums in another order (float rounding apart), and which is faster depends on
the CPU and its BLAS, so `tune` times both on the span's own weights and keeps the skinny form
only for the row counts where it is clearly faster. One row keeps nn.Linear: a lone session's
step is computed exactly as transformers computes it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ROWS = (2, 3, 4)
# The skinny form is kept for a row count where its median time is at most this fraction of
# nn.Linear's: a clear gain, not the noise of a busy machine.
CLEARLY_FASTER = 0.9
TUNE_REPS = 5
# Blocks timed: 6 blocks of the default model are 84 MB of weights.
TUNE_BLOCKS = 6


class SkinnyLinear(nn.Linear):
    """An nn.Linear that computes weight @ x.T for the row counts in `skinny_rows` (inference
    only: with autograd on it is an nn.Linear)."""

    skinny_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        if rows not in self.skinny_rows or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        out = (self.weight @ x.reshape(rows, width).T).T
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().view(*x.shape[:-1], self.out_features)


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


def tune(
    forward: Callable[[torch.Tensor], object],
    hidden_size: int,
    linears: list[SkinnyLinear],
    timer: Callable[[], float] = time.perf_counter,
) -> frozenset[int]:
    """Time `forward` (a pass through blocks whose weights come from memory, as they do when
    serving) on 2-4 rows of one token, with and without the skinny form; set and return the
    row counts where the skinny form is clearly faster."""
    if not linears:
        return frozenset()

    def timed(x: torch.Tensor, rows: frozenset[int]) -> float:
        set_rows(linears, rows)
        forward(x)  # warm
        times = []
        for _ in range(TUNE_REPS):
            started = timer()
            forward(x)
            times.append(timer() - started)
        return statistics.median(times)

    chosen = set()
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, 1, hidden_size)
            if timed(x, frozenset({rows})) <= CLEARLY_FASTER * timed(x, frozenset()):
                chosen.add(rows)
    set_rows(linears, frozenset(chosen))
    return frozenset(chosen)
