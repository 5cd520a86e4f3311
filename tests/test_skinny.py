"""blocks.skinny: a span's linear layers in the skinny form give what nn.Linear gives (float
rounding apart), only for the row counts tuning chose, never with autograd on, and tuning keeps
the form only where it is clearly faster."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import blocks
from blocks import skinny
from blocks.cache import MemoryCache
from tests.memnet import TINY_BLOCKS, save_tiny_llama


@pytest.mark.parametrize("bias", [False, True])
def test_the_skinny_form_gives_what_nn_linear_gives(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    reference = nn.Linear(64, 48, bias=bias)
    reference.load_state_dict(linear.state_dict())
    (made,) = skinny.make_skinny(nn.Sequential(linear))
    made.skinny_rows = frozenset({1, 2, 3, 4})
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, 1, 64)
        with torch.inference_mode():
            got, want = made(x), reference(x)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # With autograd on it is nn.Linear itself: gradients flow as before.
    x = torch.randn(2, 1, 64, requires_grad=True)
    made(x).sum().backward()
    assert x.grad is not None


def test_tuning_keeps_the_form_only_where_it_is_clearly_faster() -> None:
    linears = skinny.make_skinny(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    clock = [0.0]

    def forward(x: torch.Tensor) -> None:  # 1-2 rows: faster skinny; 3: 5% faster; 4: slower
        skinny_now = x.shape[0] in linears[0].skinny_rows
        clock[0] += {1: 0.6, 2: 0.5, 3: 0.95, 4: 1.2}[x.shape[0]] if skinny_now else 1.0

    assert skinny.tune(forward, 8, linears, timer=lambda: clock[0]) == frozenset({1, 2})
    assert all(linear.skinny_rows == frozenset({1, 2}) for linear in linears)


def test_a_tuned_span_merges_steps_as_before(tmp_path: Path) -> None:
    span = blocks.load_span(save_tiny_llama(tmp_path), 0, TINY_BLOCKS)
    assert span.skinny_rows <= frozenset(skinny.ROWS)
    span.skinny_rows = frozenset(skinny.ROWS)
    assert all(
        m.skinny_rows == frozenset(skinny.ROWS)
        for m in span.modules()
        if isinstance(m, skinny.SkinnyLinear)
    )
    cache = MemoryCache(budget_tokens=4096)
    hidden = span.config.hidden_size
    torch.manual_seed(1)
    prompts = [torch.randn(1, 5 + i, hidden) for i in range(3)]
    steps = [torch.randn(1, 1, hidden) for _ in range(3)]
    sessions = [cache.open_session(1, 32) for _ in range(6)]
    with torch.inference_mode():
        for prompt, a, b in zip(prompts, sessions[:3], sessions[3:], strict=True):
            span.forward(prompt, a)
            span.forward(prompt, b)
        merged = span.forward_batch(list(zip(steps, sessions[:3], strict=True)))
        alone = [span.forward(step, s) for step, s in zip(steps, sessions[3:], strict=True)]
    for got, want in zip(merged, alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
