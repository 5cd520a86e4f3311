"""Torch threads per pass (blocks.threads): prompts get the cores, decode steps keep few."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import blocks
from blocks import threads
from blocks.cache import MemoryCache
from blocks.threads import ThreadPolicy
from tests.memnet import TINY_BLOCKS, save_tiny_llama


def test_large_passes_get_prefill_threads_and_small_ones_decode_threads() -> None:
    policy = ThreadPolicy(decode=1, prefill=3, prefill_rows=16)
    assert policy.threads_for(1) == 1
    assert policy.threads_for(8) == 1  # a batch of 8 decode steps is still decode
    assert policy.threads_for(16) == 3
    assert policy.threads_for(84) == 3
    assert ThreadPolicy().threads_for(500) is None  # no policy: torch's own count


def test_the_count_is_set_in_the_thread_that_runs_the_pass() -> None:
    policy = ThreadPolicy(decode=1, prefill=2)
    seen: list[int] = []

    def worker() -> None:
        for rows in (84, 1, 1, 40):
            policy.apply(rows)
            seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [2, 1, 1, 2]


def test_configure_defaults_prefill_to_every_core_and_refuses_nonsense() -> None:
    saved, count = threads.POLICY, torch.get_num_threads()
    try:
        assert threads.configure(1).prefill == threads.available_cores()
        assert torch.get_num_threads() == 1
        assert threads.configure(None).threads_for(1000) is None
        with pytest.raises(ValueError, match="prefill threads must be >= 1"):
            ThreadPolicy(decode=1, prefill=0)
    finally:
        threads.POLICY = saved
        torch.set_num_threads(count)


def test_a_merged_pass_follows_the_policy_too(tmp_path: Path) -> None:
    span = blocks.load_span(save_tiny_llama(tmp_path), 0, TINY_BLOCKS)
    cache = MemoryCache(budget_tokens=1000)
    hidden = span.config.hidden_size
    saved, count = threads.POLICY, torch.get_num_threads()
    seen: list[int] = []

    def worker() -> None:  # a daemon's compute thread
        with cache.open_session(1, 64) as a, cache.open_session(1, 64) as b:
            span.forward(torch.randn(1, 20, hidden), a)  # a prompt: prefill threads
            seen.append(torch.get_num_threads())
            span.forward(torch.randn(1, 20, hidden), b)
            span.forward_batch([(torch.randn(1, 1, hidden), s) for s in (a, b)])  # 2 rows
            seen.append(torch.get_num_threads())

    try:
        threads.POLICY = ThreadPolicy(decode=1, prefill=2, prefill_rows=16)
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    finally:
        threads.POLICY = saved
        torch.set_num_threads(count)
    assert seen == [2, 1]


class _Clock:
    """A clock that a step moves on by a cost that depends on the thread count it runs with."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.now = 0.0
        self.cost = cost
        self.calls: list[int] = []

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        count = torch.get_num_threads()
        self.calls.append(count)
        self.now += self.cost[count]


def test_fastest_takes_the_count_whose_steps_took_least_and_leaves_the_count_alone() -> None:
    before = torch.get_num_threads()
    clock = _Clock({1: 0.010, 2: 0.013})
    assert threads.fastest(clock.step, (1, 2), rounds=3, calls=4, clock=clock) == 1
    assert torch.get_num_threads() == before
    # Rounds alternate the counts (a slow stretch falls on each), one untimed call per change.
    assert clock.calls == ([1] * 5 + [2] * 5) * 3
    clock = _Clock({1: 0.016, 2: 0.010})
    assert threads.fastest(clock.step, (1, 2), clock=clock) == 2
    assert torch.get_num_threads() == before


def test_fastest_takes_fewer_threads_when_more_gain_next_to_nothing() -> None:
    within = _Clock({1: 0.0102, 2: 0.0100})  # 2% apart: within TIE
    assert threads.fastest(within.step, (2, 1), clock=within) == 1
    beyond = _Clock({1: 0.0110, 2: 0.0100})  # 10% apart
    assert threads.fastest(beyond.step, (1, 2), clock=beyond) == 2
    with pytest.raises(ValueError, match="at least one thread count"):
        threads.fastest(within.step, ())


def test_use_decode_keeps_the_prefill_count() -> None:
    saved = threads.POLICY
    try:
        threads.POLICY = ThreadPolicy(decode=2, prefill=3, prefill_rows=16)
        policy = threads.use_decode(1)
        assert threads.POLICY is policy
        assert (policy.threads_for(1), policy.threads_for(16)) == (1, 3)
    finally:
        threads.POLICY = saved


def test_a_spans_decode_step_is_timed_on_each_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    span = blocks.load_span(save_tiny_llama(tmp_path), 0, TINY_BLOCKS)
    policy = ThreadPolicy(decode=2, prefill=2)
    monkeypatch.setattr(threads, "POLICY", policy)
    ran_on: list[int] = []
    forward = span.forward

    def counted(*args: object, **kwargs: object) -> object:
        result = forward(*args, **kwargs)  # the span sets its pass's count from the policy
        ran_on.append(torch.get_num_threads())
        return result

    monkeypatch.setattr(span, "forward", counted)
    count = torch.get_num_threads()
    try:
        assert blocks.fastest_decode_threads(span, (1, 2), rounds=2) in (1, 2)
        # Warm-up on the policy's count; then per round one untimed and six timed steps a count.
        assert ran_on[2:] == ([1] * 7 + [2] * 7) * 2
        assert blocks.fastest_decode_threads(span, (1,), rounds=1) == 1
        ran_on.clear()  # a budget too short for a round still times one
        assert blocks.fastest_decode_threads(span, (1, 2), budget_s=1e-9) in (1, 2)
        assert ran_on[2:] == [1] * 7 + [2] * 7
        # The policy is the caller's again, and the thread's count what the policy last set (its
        # memory of it must hold: it sets a count only when it changes).
        assert threads.POLICY is policy and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(count)


async def test_a_daemon_without_torch_threads_keeps_the_faster_decode_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peerd.daemon import startup

    span = blocks.load_span(save_tiny_llama(tmp_path), 0, TINY_BLOCKS)
    tried: list[tuple[int, ...]] = []

    def timed(span_: blocks.Span, counts: tuple[int, ...]) -> int:
        tried.append(tuple(counts))
        return 1

    monkeypatch.setattr(blocks, "fastest_decode_threads", timed)
    monkeypatch.setattr(threads, "POLICY", ThreadPolicy(decode=4, prefill=4))
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    await startup.choose_decode_threads(span)
    assert tried == [(1, 4)]
    assert (threads.POLICY.decode, threads.POLICY.prefill) == (1, 4)
    # One core: nothing to choose between.
    monkeypatch.setattr(threads, "available_cores", lambda: 1)
    await startup.choose_decode_threads(span)
    assert tried == [(1, 4)]
