"""blocks.skinny: a span's linear layers in the skinny form, and with oneDNN's packed weights,
give what nn.Linear gives (float rounding apart), only for the row counts tuning chose, never
with autograd on, and tuning keeps each form only where it is clearly faster."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import blocks
from blocks import skinny
from blocks.cache import MemoryCache
from tests.memnet import TINY_BLOCKS, save_tiny_llama


def _skinny_and_plain(bias: bool, rows: tuple[int, ...]) -> skinny.SkinnyLinear:
    """A SkinnyLinear (skinny for 1-4 rows, packed where `rows` reach PACKED_ROWS) checked
    against the nn.Linear it was, on passes of each of `rows` rows."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    reference = nn.Linear(64, 48, bias=bias)
    reference.load_state_dict(linear.state_dict())
    (made,) = skinny.make_skinny(nn.Sequential(linear))
    made.skinny_rows = frozenset({1, 2, 3, 4})
    skinny.set_packed([made], skinny.packable() and any(r in skinny.PACKED_ROWS for r in rows))
    for count in rows:
        x = torch.randn(count, 1, 64)
        with torch.inference_mode():
            got, want = made(x), reference(x)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # With autograd on it is nn.Linear itself: gradients flow as before.
    x = torch.randn(max(rows), 1, 64, requires_grad=True)
    made(x).sum().backward()
    assert x.grad is not None
    return made


@pytest.mark.parametrize("bias", [False, True])
def test_the_skinny_form_gives_what_nn_linear_gives(bias: bool) -> None:
    _skinny_and_plain(bias, (1, 2, 3, 4))


@pytest.mark.skipif(not skinny.packable(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_form_gives_what_nn_linear_gives(bias: bool) -> None:
    made = _skinny_and_plain(bias, (1, 4, 5, 8, 15, 16, 40))
    assert made.packed is not None
    # Which rows take the packed copy: with a copy of zeros, exactly PACKED_ROWS give the bias.
    made.packed = torch.ops.mkldnn._reorder_linear_weight(
        torch.zeros(48, 64), skinny.PACKED_TUNE_ROWS
    )
    for rows in range(1, 20):
        with torch.inference_mode():
            out = made(torch.randn(rows, 1, 64))
        bias_only = torch.equal(out, torch.zeros_like(out) + (made.bias if bias else 0))
        assert bias_only == (rows in skinny.PACKED_ROWS), rows
    skinny.set_packed([made], False)
    assert made.packed is None


@pytest.mark.parametrize("packed_time", [0.5, 0.95])
def test_tuning_keeps_the_forms_only_where_they_are_clearly_faster(packed_time: float) -> None:
    linears = skinny.make_skinny(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    clock = [0.0]

    def forward(x: torch.Tensor) -> None:  # 1-2 rows: faster skinny; 3: 5% faster; 4: slower
        rows = x.shape[0]
        if rows == skinny.PACKED_TUNE_ROWS:
            clock[0] += packed_time if linears[0].packed is not None else 1.0
            return
        skinny_now = rows in linears[0].skinny_rows
        clock[0] += {1: 0.6, 2: 0.5, 3: 0.95, 4: 1.2}[rows] if skinny_now else 1.0

    assert skinny.tune(forward, 8, linears, timer=lambda: clock[0]) == frozenset({1, 2})
    assert all(linear.skinny_rows == frozenset({1, 2}) for linear in linears)
    assert all(linear.packed is None for linear in linears)  # a server's choice (compile_passes)
    keep = skinny.packable() and packed_time < skinny.CLEARLY_FASTER
    assert skinny.tune_packed(forward, 8, linears, timer=lambda: clock[0]) == keep
    assert all((linear.packed is not None) == keep for linear in linears)
    # Copies that the server's memory budget leaves no room for are not made, however fast.
    size = sum(linear.weight.nbytes for linear in linears)
    skinny.set_packed(linears, False)
    assert not skinny.tune_packed(forward, 8, linears, timer=lambda: clock[0], room=size - 1)
    assert all(linear.packed is None for linear in linears)
    assert skinny.tune_packed(forward, 8, linears, timer=lambda: clock[0], room=size) == keep


@pytest.mark.parametrize("sessions_merged", [3, 6])
def test_a_tuned_span_merges_steps_as_before(tmp_path: Path, sessions_merged: int) -> None:
    """3 merged steps in the skinny form, 6 with packed weights where oneDNN is there."""
    span = blocks.load_span(save_tiny_llama(tmp_path), 0, TINY_BLOCKS)
    assert span.skinny_rows <= frozenset(skinny.ROWS)
    span.skinny_rows = frozenset(skinny.ROWS)
    linears = [m for m in span.modules() if isinstance(m, skinny.SkinnyLinear)]
    skinny.set_packed(linears, skinny.packable())
    assert all(m.skinny_rows == frozenset(skinny.ROWS) for m in linears)
    cache = MemoryCache(budget_tokens=4096)
    hidden = span.config.hidden_size
    torch.manual_seed(1)
    n = sessions_merged
    prompts = [torch.randn(1, 5 + i, hidden) for i in range(n)]
    steps = [torch.randn(1, 1, hidden) for _ in range(n)]
    sessions = [cache.open_session(1, 32) for _ in range(2 * n)]
    with torch.inference_mode():
        for prompt, a, b in zip(prompts, sessions[:n], sessions[n:], strict=True):
            span.forward(prompt, a)
            span.forward(prompt, b)
        merged = span.forward_batch(list(zip(steps, sessions[:n], strict=True)))
        alone = [span.forward(step, s) for step, s in zip(steps, sessions[n:], strict=True)]
    for got, want in zip(merged, alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
