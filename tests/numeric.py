"""Float comparisons whose tolerance scales with the values compared.

fp32 rounding grows with the magnitude of the activations (the tiny random models' reach 100 and
more), and it differs between machines (BLAS kernels, thread counts), so an absolute bound that
holds on one machine fails on another. A bound relative to the largest value compared holds on
any of them, and a real bug (a wrong mask, a missing block, a cache off by one) still moves the
output by a sizeable fraction of that scale: far more than any of these bounds.
"""

from __future__ import annotations

import torch

# The same math done another way (rows batched, a prompt in chunks, steps merged): the rounding
# measured stays under 3e-6 of the largest value.
REL = 1e-5
# Logits after a chain of spans run step by step with KV caches, against one full pass: rounding
# adds up over every block and step (up to 9e-6 measured, on the mixture-of-experts model).
CHAINED = 5e-5
# The same operations on the same weights (a sub-span, a sharded or renamed checkpoint, a server
# call against the span it runs): equal but for the last bits (up to 2e-7 measured).
SAME = 1e-6


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, *, rel: float = REL) -> None:
    """`actual` equals `expected` within `rel` times the largest magnitude in `expected`."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    bound = rel * scale

    def message(default: str) -> str:
        return f"{default}\nallowed: {rel:g} of the largest |expected| ({scale:.3g}) = {bound:.3g}"

    torch.testing.assert_close(actual, expected, rtol=0, atol=bound, msg=message)
