"""Greedy tokens from a CPU LM head that reads a half-precision copy of its weight, exactly.

Greedy decoding needs only the argmax of the logits, and a decode step's LM head on a CPU is
bound by reading the [vocab, hidden] matrix. So the head first reads a float16 copy (half the
bytes: the default model's head, one row, 6.4 ms against 10.0 ms for the best float32 form on one
thread of the development machine, 3.8 against 7.0 on two), bounds how far each approximate logit
can be from the float32 one, and computes in float32 only the candidates whose bound reaches the
best lower bound: usually one to three tokens. The token is the argmax of their float32 logits,
so it is the token the float32 head picks (float rounding between the two float32 forms aside,
as between any two forms of the head).

The bound, for logit i of weight row w and hidden row h (w16, h16 the float16 copies, their
products exact in float32, summed in float32 over K = hidden terms, the sum rounded to float16):

    |a_i - w.h| <= |w - w16| |h| + |w| |h - h16| + |w - w16| |h - h16|     (the conversions)
                 + K u32 (|w| + |w - w16|) (|h| + |h - h16|)                 (the float32 sum)
                 + |a_i| 2^-10                                                (the float16 result)

with Euclidean norms. It holds only for a kernel that sums in float32 (torch's CPU float16
matrix-vector product does); `HalfShortlist.kernel_sums_in_float32` checks that on sample rows
against float64, and `blocks.client_side.ClientSide.tune_greedy` keeps the shortlist only where
it passes and is clearly faster. A hidden row outside float16's range, or any non-finite value,
takes the full float32 head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOAT32_UNIT = 2.0**-24
# Twice float16's unit roundoff: the bound takes the rounded result's magnitude, not the sum's.
FLOAT16_RESULT = 2.0**-10
# float16's unit roundoff: the kernel check allows the result one rounding of the exact sum's size.
FLOAT16_UNIT = 2.0**-11
# The bound's own float32 arithmetic (norms, products): a relative and an absolute margin on top.
SAFETY = 1.001
TINY = 1e-6
# Weight rows and hidden rows the kernel check multiplies in float64.
CHECK_VOCAB = 4096
CHECK_ROWS = 8


class HalfShortlist:
    """A float16 copy of an LM head's float32 `weight` [vocab, hidden] (no bias, no soft-cap),
    and the per-row figures its error bound needs."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.half = self.weight.half()
        self.finite = bool(torch.isfinite(self.half).all())
        self.norms = self.weight.norm(dim=1)
        self.half_error = (self.weight - self.half.float()).norm(dim=1)
        self.sum_error = self.weight.shape[1] * FLOAT32_UNIT

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rows [n, hidden] (float32, after the final norm) -> the argmax of each row's float32
        logits [n]; None where the half-precision pass cannot bound them (non-finite values,
        a row beyond float16's range)."""
        if not self.finite:
            return None
        small = hidden.half()
        approx = F.linear(small, self.half).float()
        if not bool(torch.isfinite(approx).all()):
            return None
        bound = self._bound(hidden, small, approx)
        tokens = []
        for row, logits, margin in zip(hidden, approx, bound, strict=True):
            best_low = (logits - margin).max()
            candidates = torch.nonzero(logits + margin >= best_low).flatten()
            if candidates.numel() == 0:
                return None
            exact = self.weight.index_select(0, candidates) @ row
            tokens.append(candidates[exact.argmax()])
        return torch.stack(tokens)

    def _bound(
        self, hidden: torch.Tensor, small: torch.Tensor, approx: torch.Tensor
    ) -> torch.Tensor:
        size = hidden.norm(dim=1, keepdim=True)
        lost = (hidden - small.float()).norm(dim=1, keepdim=True)
        conversions = self.half_error * size + self.norms * lost + self.half_error * lost
        summing = self.sum_error * (self.norms + self.half_error) * (size + lost)
        return (conversions + summing + approx.abs() * FLOAT16_RESULT) * SAFETY + TINY

    def kernel_sums_in_float32(self, seed: int = 0) -> bool:
        """Whether this machine's float16 product stays within the bound's arithmetic terms on
        sample rows: compared with the float64 product of the same float16 values, so only the
        kernel's own summing and rounding count (a kernel that sums in float16 errs hundreds of
        times more, and one that rounds partial sums to float16 more than this one rounding of
        the result allows)."""
        if not self.finite:
            return False
        generator = torch.Generator().manual_seed(seed)
        scale = float(self.norms.median()) or 1.0
        rows = torch.randn(CHECK_ROWS, self.weight.shape[1], generator=generator) / scale
        small = rows.half()
        part = self.half[:CHECK_VOCAB]
        got = F.linear(small, part).double()
        want = small.double() @ part.double().T
        magnitude = small.double().abs() @ part.double().abs().T
        allowed = (self.sum_error * magnitude + want.abs() * FLOAT16_UNIT) * SAFETY + TINY
        return bool(((got - want).abs() <= allowed).all())
