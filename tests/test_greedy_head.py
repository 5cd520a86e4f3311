"""The half-precision shortlist of greedy tokens (blocks.greedy_head): the float32 head's argmax
whenever the float16 pass alone would pick another token, the float32 head where it cannot bound
its error, and tuning that keeps it only where it is exact enough and clearly faster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import blocks
from blocks import client_side, greedy_head
from blocks.greedy_head import HalfShortlist
from peerd.session.generation import Generator, _NextToken
from peerd.session.sampling import SamplingParams

VOCAB, HIDDEN = 3000, 64


def _near_ties(rows: int, gap: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and hidden rows whose two best logits (100 and 100 - 100 * gap, the others about
    N(0, 8)) differ by less than float16 can tell apart and far more than float32 rounding."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5
    hidden = torch.randn(rows, HIDDEN, generator=generator) * 8
    for i, row in enumerate(hidden):
        along = row / row.norm() ** 2
        for token, logit in ((i * 7, 100.0), (i * 7 + 1000, 100.0 * (1 - gap))):
            weight[token] += (logit - weight[token] @ row) * along
    return weight, hidden


def test_the_shortlist_picks_the_float32_argmax_where_float16_alone_would_not() -> None:
    weight, hidden = _near_ties(64, gap=5e-6, seed=1)
    shortlist = HalfShortlist(weight)
    want = (hidden.double() @ weight.double().T).argmax(dim=1)
    half_alone = (hidden.half().float() @ weight.half().float().T).argmax(dim=1)
    assert (half_alone != want).any(), "the float16 pass must err somewhere for this to test"
    got = shortlist.argmax(hidden)
    assert got is not None
    assert torch.equal(got, want)
    assert torch.equal(got, (hidden @ weight.T).argmax(dim=1))


def test_random_rows_agree_with_the_float32_head() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.05
    hidden = torch.randn(200, HIDDEN, generator=generator) * 10
    got = HalfShortlist(weight).argmax(hidden)
    assert got is not None
    assert torch.equal(got, (hidden @ weight.T).argmax(dim=1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e6])
def test_rows_it_cannot_bound_take_the_float32_head(bad: float) -> None:
    weight = torch.randn(VOCAB, HIDDEN) * 0.05
    hidden = torch.randn(2, HIDDEN)
    hidden[1, 3] = bad  # 1e6 is beyond float16's range
    assert HalfShortlist(weight).argmax(hidden) is None


def test_a_weight_beyond_float16_is_never_shortlisted() -> None:
    weight = torch.randn(VOCAB, HIDDEN)
    weight[5, 5] = 1e6
    shortlist = HalfShortlist(weight)
    assert shortlist.argmax(torch.randn(1, HIDDEN)) is None
    assert not shortlist.kernel_sums_in_float32()


def _sums_in_float16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float16)
    for k in range(x.shape[1]):
        total = total + x[:, k : k + 1] * w[:, k]  # every partial sum rounded to float16
    return total


def _rounds_every_16_terms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float16)
    for k in range(0, x.shape[1], 16):  # float32 within a block, rounded at its end
        block = x[:, k : k + 16].float() @ w[:, k : k + 16].float().T
        total = (total.float() + block).half()
    return total


@pytest.mark.parametrize("rough", [_sums_in_float16, _rounds_every_16_terms])
def test_the_kernel_check_passes_here_and_fails_rougher_kernels(
    rough: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shortlist = HalfShortlist(torch.randn(VOCAB, HIDDEN) * 0.05)
    assert shortlist.kernel_sums_in_float32()
    monkeypatch.setattr(greedy_head.F, "linear", rough)
    assert not shortlist.kernel_sums_in_float32()


def test_tuning_keeps_the_shortlist_only_where_clearly_faster_and_exact_enough(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = blocks.load_client_side(tiny_llama)
    hidden = torch.randn(2, client.config.hidden_size) * 5
    # A clock each way advances by its own cost: the shortlist 1, the float32 head 3.
    clock, cost = [0.0], [1.0]
    real_argmax = HalfShortlist.argmax

    def timed_argmax(self: HalfShortlist, rows: torch.Tensor) -> Any:
        clock[0] += cost[0]
        return real_argmax(self, rows)

    monkeypatch.setattr(HalfShortlist, "argmax", timed_argmax)
    hook = client.lm_head.register_forward_hook(lambda *_: clock.__setitem__(0, clock[0] + 3))
    monkeypatch.setattr(client, "_linear_for", lambda _hidden: True)  # the head as nn.Linear
    try:
        assert client.tune_greedy(timer=lambda: clock[0]) == frozenset(client_side.SHORTLIST_ROWS)
        assert client.shortlist is not None
        with torch.inference_mode():
            assert torch.equal(
                client.greedy(hidden[:1]), client.logits(hidden[:1]).argmax(-1, True)
            )
            assert torch.equal(client.greedy(hidden), client.logits(hidden).argmax(-1, True))
        cost[0] = 3.0  # as slow as the float32 head: not kept, and the copy goes
        assert client.tune_greedy(timer=lambda: clock[0]) == frozenset()
        assert client.shortlist is None
        cost[0] = 1.0
        monkeypatch.setattr(HalfShortlist, "kernel_sums_in_float32", lambda self: False)
        assert client.tune_greedy(timer=lambda: clock[0]) == frozenset()
        assert client.shortlist is None
    finally:
        hook.remove()


def test_no_shortlist_without_room_or_with_a_soft_capped_head(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = blocks.load_client_side(tiny_llama)

    class Tight:
        available = 0

    monkeypatch.setattr(client_side.psutil, "virtual_memory", lambda: Tight())
    assert client.tune_greedy() == frozenset() and client.shortlist is None
    monkeypatch.undo()
    client.lm_head.softcap = 30.0
    assert client.tune_greedy() == frozenset() and client.shortlist is None


def test_only_plain_greedy_requests_take_the_greedy_head(tiny_llama: Path) -> None:
    client = blocks.load_client_side(tiny_llama)
    calls: list[str] = []
    greedy, logits = client.greedy, client.logits
    client.greedy = lambda h: calls.append("greedy") or greedy(h)  # type: ignore[method-assign]
    client.logits = lambda h: calls.append("logits") or logits(h)  # type: ignore[method-assign]
    generator = Generator(client, swarm=None)  # type: ignore[arg-type]
    hidden = torch.randn(1, client.config.hidden_size)
    ids = torch.tensor([[1, 2, 3]])

    def request(**params: Any) -> _NextToken:
        return _NextToken(hidden, ids, SamplingParams(**params), torch.Generator())

    plain = generator._sample_rows([request(), request()])
    assert calls[0] == "greedy"  # (which takes the float32 head itself: no rows kept here)
    assert [t.shape for t in plain] == [(1, 1), (1, 1)]
    expected = logits(torch.cat([hidden, hidden])).argmax(-1, keepdim=True)
    assert torch.equal(torch.cat(plain), expected)
    for params in ({"repetition_penalty": 1.3}, {"do_sample": True, "seed": 3}):
        calls.clear()
        generator._sample_rows([request(), request(**params)])
        assert calls == ["logits"]
