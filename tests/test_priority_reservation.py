"""Takers' turns held back while a contributor is active (peerd.server.priority.Reservation):
the rule on a hand-moved clock, a device simulated on it (what each class gets), then a real
batcher on trio's MockClock with its turns timed by a fake timer. Nothing here asserts on wall
time."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
import trio
import trio.testing

import blocks
from blocks import MemoryCache, SpanSession
from peerd.daemon.metrics import _standing, render
from peerd.server.batching import (
    GATHER_MAX_S,
    GATHER_MIN_S,
    PRIORITY_TURN_TOKENS,
    RESERVED_GATHER_S,
    RESERVED_TURN_TOKENS,
    StepBatcher,
)
from peerd.server.block_server import BlockServer
from peerd.server.compute import ComputeQueue
from peerd.server.lane import LANE_NICE, lanes_supported
from peerd.server.priority import (
    CONTRIBUTOR_ACTIVE_S,
    TAKER_REST,
    TAKER_SHARE,
    Priority,
    Reservation,
)
from peerd.server.standing import Standing
from tests.test_routing_fixtures import MODEL
from tests.test_standing import Clock
from tests.tiny_models import save_tiny

NUM_BLOCKS = 30


def _priority(clock: Clock | None = None, enabled: bool = True) -> Priority:
    """A priority on which "C" is a contributor (a third of the model) and anyone else a taker."""
    standing = Standing(num_blocks=NUM_BLOCKS, qualify_s=0, clock=clock or time.monotonic)
    standing.saw_serving("C", 10, 1.0)
    return Priority(standing, enabled=enabled)  # on the standing's clock


# --- the rule ------------------------------------------------------------------------------------


def test_a_takers_turn_rests_while_a_contributor_is_active_and_not_otherwise() -> None:
    clock = Clock()
    reservation = Reservation(_priority(clock))
    # Nobody with standing about: takers' turns go back to back.
    reservation.stepped("taker", clock.now)
    reservation.taker_turn_ran(0.1, clock.now)
    assert reservation.taker_wait(clock.now) == 0 and reservation.rests == 0
    # The contributor steps: the next takers' turn of 0.1 s rests TAKER_REST times as long.
    reservation.stepped("C", clock.now)
    reservation.taker_turn_ran(0.1, clock.now)
    assert reservation.taker_wait(clock.now) == pytest.approx(TAKER_REST * 0.1)
    clock.now += 0.05
    assert reservation.taker_wait(clock.now) == pytest.approx(TAKER_REST * 0.1 - 0.05)
    clock.now += TAKER_REST * 0.1
    assert reservation.taker_wait(clock.now) == 0
    assert reservation.rests == 1 and reservation.rested_s == pytest.approx(TAKER_REST * 0.1)
    # The contributor went quiet: a rest under way ends, and no new one starts.
    reservation.taker_turn_ran(0.1, clock.now)
    assert reservation.taker_wait(clock.now) > 0
    clock.now += CONTRIBUTOR_ACTIVE_S + 0.01
    assert reservation.taker_wait(clock.now) == 0
    reservation.taker_turn_ran(0.1, clock.now)
    assert reservation.taker_wait(clock.now) == 0 and reservation.rests == 2


def test_fifo_never_holds_takers_back() -> None:
    clock = Clock()
    reservation = Reservation(_priority(clock, enabled=False))
    reservation.stepped("C", clock.now)
    reservation.taker_turn_ran(1.0, clock.now)
    assert reservation.taker_wait(clock.now) == 0
    assert reservation.rests == 0 and reservation.rested_s == 0


def test_takers_owed_their_share_are_not_held_back() -> None:
    clock = Clock()
    priority = _priority(clock)
    reservation = Reservation(priority)
    priority.account("C", 1000)
    priority.account("taker", 100)  # 9%: under TAKER_SHARE
    reservation.stepped("C", clock.now)
    reservation.taker_turn_ran(0.1, clock.now)
    assert reservation.taker_wait(clock.now) == 0 and reservation.rests == 0
    priority.account("taker", 1000)  # 52%
    reservation.taker_turn_ran(0.1, clock.now)
    assert reservation.taker_wait(clock.now) > 0


# --- a device simulated on the hand clock ----------------------------------------------------


def _simulate(
    priority: Priority, *, tokens: int, gap_s: float | None, seconds: float = 100.0
) -> dict[str, float]:
    """One device, always some takers' work waiting (a turn of RESERVED_TURN_TOKENS tokens costs
    0.05 s), and the contributor "C" sending a step of `tokens` tokens `gap_s` after its last
    one came back (0.01 s + 0.002 s per token; gap_s None: no contributor). What each class got:
    tokens, device seconds, and the contributor's mean wait per step."""
    clock = priority.clock
    assert isinstance(clock, Clock)
    reservation = Reservation(priority)
    end = clock.now + seconds  # within C's standing's decay: it stays a contributor
    ready = clock.now if gap_s is not None else float("inf")  # when C's next step arrives
    got = {"C": 0.0, "taker": 0.0, "taker_s": 0.0, "waited_s": 0.0, "steps": 0.0}
    while clock.now < end:
        if ready <= clock.now:  # C's step waits (with takers'): the order decides
            reservation.stepped("C", ready)
            # (the caller's fair order: C's step came after the takers' last turn)
            first = priority.order(["C", "taker"], owner=str)[0]
        elif reservation.taker_wait(clock.now) == 0:
            first = "taker"
        else:  # the device rests until the rest ends or C's step comes
            clock.now = min(ready, clock.now + reservation.taker_wait(clock.now))
            continue
        if first == "C":
            work, cost = tokens, 0.01 + 0.002 * tokens
        else:
            work, cost = RESERVED_TURN_TOKENS, 0.05
        priority.account(first, work)
        if first == "C":
            got["waited_s"] += clock.now - ready
            got["steps"] += 1
        clock.now += cost
        got[first] += work
        if first == "taker":
            got["taker_s"] += cost
            reservation.taker_turn_ran(cost, clock.now)
        else:
            ready = clock.now + (gap_s or 0.0)
    got["taker_duty"] = got["taker_s"] / seconds
    got["taker_share"] = got["taker"] / (got["taker"] + got["C"])
    return got


def test_a_decoding_contributor_finds_the_device_free_and_takers_keep_their_share() -> None:
    alone = _simulate(_priority(Clock()), tokens=1, gap_s=None)
    assert alone["taker_duty"] > 0.99  # work-conserving: no contributor, no rest
    with_c = _simulate(_priority(Clock()), tokens=1, gap_s=0.15)
    # Takers have about 1 / (1 + TAKER_REST) of the device (a little less: C's turns)...
    assert 1 / (1 + TAKER_REST) - 0.05 < with_c["taker_duty"] <= 1 / (1 + TAKER_REST) + 0.01
    assert pytest.approx(TAKER_SHARE) == 1 / (1 + TAKER_REST)  # their guarantee, no more
    assert with_c["taker_share"] > 0.9  # ...and still nearly all the tokens
    # C's step waits on average at most a fifth of half a takers' turn (under way when it came).
    assert with_c["waited_s"] / with_c["steps"] <= 0.05 / 2 / (1 + TAKER_REST) + 0.002
    fifo = _simulate(_priority(Clock(), enabled=False), tokens=1, gap_s=0.15)
    assert fifo["taker_duty"] > 0.9  # fifo: takers' turns back to back, C waits its turn
    assert fifo["waited_s"] / fifo["steps"] > 2 * with_c["waited_s"] / with_c["steps"]


def test_takers_keep_their_share_under_a_contributor_that_would_take_the_device() -> None:
    got = _simulate(_priority(Clock()), tokens=256, gap_s=0.001)
    assert got["taker_share"] >= TAKER_SHARE - 0.01


# --- a real batcher --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def span(tmp_path_factory: pytest.TempPathFactory) -> blocks.Span:
    path: Path = save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return blocks.load_span(path, 0, 3)


class _Ticks:
    """perf_counter's stand-in for the batcher's turn timer: each call moves it `turn_s` on, so
    every turn of takers' work alone (timed from one call to the next) ran `turn_s`."""

    def __init__(self, turn_s: float) -> None:
        self.now, self.turn_s = 0.0, turn_s

    def __call__(self) -> float:
        self.now += self.turn_s
        return self.now


@pytest.mark.parametrize(
    ("first", "enabled", "turns", "rests"),
    [("C", True, 5, 5), ("someone", True, 2, 0), ("C", False, 1, 0)],
    ids=["standing-contributor-active", "standing-takers-only", "fifo"],
)
async def test_a_takers_prefill_rests_between_its_turns_only_while_a_contributor_is_active(
    span: blocks.Span,
    autojump_clock: trio.testing.MockClock,
    first: str,
    enabled: bool,
    turns: int,
    rests: int,
) -> None:
    """After a step of `first`, a taker's prefill of PRIORITY_TURN_TOKENS + 8 tokens: by
    standing, with the contributor active, turns of RESERVED_TURN_TOKENS each resting
    TAKER_REST times its 0.05 s; with only takers about, 2 turns of PRIORITY_TURN_TOKENS and no
    rest; fifo: its whole chunk at once. The same result every way."""
    cache = MemoryCache(budget_tokens=10_000)
    prompt = torch.randn(1, PRIORITY_TURN_TOKENS + 8, 32)
    assert span.chunk_tokens >= prompt.shape[1]
    assert math.ceil(prompt.shape[1] / RESERVED_TURN_TOKENS) == 5  # the parameters' turns
    assert 5 * 0.05 * (1 + TAKER_REST) < CONTRIBUTOR_ACTIVE_S  # the contributor stays active
    with cache.open_session(1, 256) as reference:
        want = span(prompt, reference)
    priority = _priority(enabled=enabled)
    priority.account("someone", 1000)  # takers had their share lately
    # On a CPU server the turns held back run in the lane, whose rests follow its CPU clock.
    batcher = StepBatcher(
        ComputeQueue(), priority=priority, timer=_Ticks(0.05), cpu_timer=_Ticks(0.05)
    )
    assert batcher.reservation is not None
    with cache.open_session(1, 256) as session, cache.open_session(1, 8) as other:
        await batcher.run(span, other, torch.randn(1, 1, 32), owner=first)
        before, began = batcher.counters.forwards, trio.current_time()
        got = await batcher.run(span, session, prompt, owner="taker")
        took = trio.current_time() - began
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert batcher.counters.forwards - before == turns
    assert batcher.reservation.rests == rests
    assert batcher.reservation.rested_s == pytest.approx(rests * TAKER_REST * 0.05)
    # The rests between its turns (not the one after its last) delayed the prefill.
    assert took >= max(0, rests - 1) * TAKER_REST * 0.05 - 1e-9


@pytest.mark.skipif(not lanes_supported(), reason="no low-priority lane on this platform")
async def test_a_lane_turn_that_ends_before_the_event_loop_looks_still_rests(
    span: blocks.Span, autojump_clock: trio.testing.MockClock
) -> None:
    """The race CI once lost: a takers' turn in the lane ends (its step back in the queue)
    before the event loop has taken the turn's end, where its rest starts. The step must wait
    for that, not start its next turn at once with the rest still unknown. Here every turn's
    end reaches the event loop 0.01 s late, after the lane job is done and its round's caller
    has gone on, so a step that did not wait ran its turns back to back."""
    cache = MemoryCache(budget_tokens=10_000)
    prompt = torch.randn(1, PRIORITY_TURN_TOKENS + 8, 32)
    priority = _priority()
    priority.account("someone", 1000)  # takers had their share lately
    batcher = StepBatcher(
        ComputeQueue(), priority=priority, timer=_Ticks(0.05), cpu_timer=_Ticks(0.05)
    )
    assert batcher.lane is not None and batcher.reservation is not None
    lane_done = threading.Event()
    real_submit, real_run = batcher.lane.submit, batcher.compute.run
    real_turn_over = batcher._lane_turn_over

    def submit(job: Callable[[], None]) -> None:
        def done_after() -> None:
            try:
                job()
            finally:
                lane_done.set()

        lane_done.clear()
        real_submit(done_after)

    resumed = [trio.Event()]  # set when the round's caller goes on after the lane's turn

    async def run(*args: object, **kwargs: object) -> None:
        lane_done.set()  # unless this round hands its turn to the lane
        resumed[0] = trio.Event()
        await real_run(*args, **kwargs)  # type: ignore[arg-type]
        await trio.to_thread.run_sync(lane_done.wait)  # the lane's turn is over, in its thread
        resumed[0].set()

    async with trio.open_nursery() as nursery:

        async def late(cpu_s: float) -> None:
            await resumed[0].wait()
            await trio.sleep(0.01)
            real_turn_over(cpu_s)

        batcher.lane.submit = submit  # type: ignore[method-assign]
        batcher.compute.run = run  # type: ignore[method-assign,assignment]
        batcher._lane_turn_over = lambda cpu_s: nursery.start_soon(late, cpu_s)  # type: ignore[method-assign]
        with cache.open_session(1, 256) as session, cache.open_session(1, 8) as other:
            await batcher.run(span, other, torch.randn(1, 1, 32), owner="C")
            began = trio.current_time()
            await batcher.run(span, session, prompt, owner="taker")
            took = trio.current_time() - began
    assert batcher.reservation.rests == 5
    assert took >= 4 * TAKER_REST * 0.05 - 1e-9


async def _spin_until(condition: Callable[[], bool]) -> None:
    """Yield until `condition` holds (on a clock that stands still: no sleeping)."""
    give_up = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < give_up, "the batcher never got there"
        await trio.sleep(0)


async def test_a_contributors_step_during_the_takers_rest_runs_at_once(
    span: blocks.Span, mock_clock: trio.testing.MockClock
) -> None:
    """On a clock that moves only when told: the contributor's step runs while the takers' rest
    holds (held back, it would wait forever), then the prefill goes on once time passes."""
    cache = MemoryCache(budget_tokens=10_000)
    priority = _priority()
    priority.account("someone", 1000)  # takers had their share lately
    batcher = StepBatcher(
        ComputeQueue(), priority=priority, timer=_Ticks(0.1), cpu_timer=_Ticks(0.1)
    )
    reservation = batcher.reservation
    assert reservation is not None
    prompt = torch.randn(1, 3 * RESERVED_TURN_TOKENS + 8, 32)
    with cache.open_session(1, 256) as taker, cache.open_session(1, 8) as contributor:
        await batcher.run(span, contributor, torch.randn(1, 1, 32), owner="C")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.run, span, taker, prompt, "taker")
            await _spin_until(lambda: reservation.rests == 1)  # its first turn ran: a rest
            assert batcher.counters.forwards == 2
            assert reservation.taker_wait(trio.current_time()) == pytest.approx(TAKER_REST * 0.1)
            await batcher.run(span, contributor, torch.randn(1, 1, 32), owner="C")
            assert batcher.counters.forwards == 3  # the contributor's step, alone
            assert reservation.taker_wait(trio.current_time()) == pytest.approx(TAKER_REST * 0.1)
            assert taker.position == RESERVED_TURN_TOKENS  # the prefill waits
            for rests in (2, 3):  # its next turns, each after a rest, resting in turn
                mock_clock.jump(TAKER_REST * 0.1 * 1.001)  # past float rounding of the ticks
                await _spin_until(lambda: reservation.rests == rests)  # noqa: B023
            # Its last turn, once the contributor has been quiet for CONTRIBUTOR_ACTIVE_S: no rest.
            mock_clock.jump(CONTRIBUTOR_ACTIVE_S)
        assert taker.position == prompt.shape[1]
        assert batcher.counters.forwards == 6 and reservation.rests == 3


async def _both_wait_then_run(
    batcher: StepBatcher, span: blocks.Span, first: tuple[str, SpanSession], then: SpanSession
) -> list[str]:
    """With the device held, a decode step of `first` (owner, session), then one of "C" on
    `then`; the device freed once both wait. The owners in the order their steps finished."""
    done: list[str] = []

    async def step(owner: str, session: SpanSession) -> None:
        await batcher.run(span, session, torch.randn(1, 1, 32), owner=owner)
        done.append(owner)

    gate = threading.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.compute.run, 0, gate.wait)
            await _spin_until(lambda: batcher.compute.depth == 1)
            nursery.start_soon(step, *first)
            await _spin_until(lambda: len(batcher._waiting) == 1)
            nursery.start_soon(step, "C", then)
            await _spin_until(lambda: len(batcher._waiting) == 2)
            gate.set()
    finally:
        gate.set()
    return done


@pytest.mark.parametrize("enabled", [True, False], ids=["standing", "fifo"])
async def test_while_reserved_a_contributors_round_takes_no_takers_rows(
    span: blocks.Span, enabled: bool
) -> None:
    """A taker's decode step and then a contributor's wait for the device: by standing the
    contributor's runs first and alone (eight takers' rows would add half to its forward),
    then the taker's in a turn of its own; fifo merges them into one forward."""
    cache = MemoryCache(budget_tokens=10_000)
    priority = _priority(enabled=enabled)
    priority.account("someone", 1000)  # takers had their share lately
    batcher = StepBatcher(ComputeQueue(), priority=priority)
    with cache.open_session(1, 8) as taker, cache.open_session(1, 8) as contributor:
        done = await _both_wait_then_run(batcher, span, ("taker", taker), contributor)
    if enabled:
        assert done == ["C", "taker"]
        assert batcher.counters.forwards == 2 and batcher.counters.merged_steps == 0
    else:
        assert sorted(done) == ["C", "taker"]
        assert batcher.counters.forwards == 1 and batcher.counters.merged_steps == 2


@pytest.mark.parametrize("enabled", [True, False], ids=["standing", "fifo"])
async def test_while_reserved_a_contributors_step_waits_for_no_takers_partner(
    span: blocks.Span, autojump_clock: trio.testing.MockClock, enabled: bool
) -> None:
    """A contributor's session that last ran in one forward with a taker's: its next step, on a
    free device, waits (GATHER_MIN_S at least) for the taker's to come too, unless the device is
    reserved for contributors (standing, takers not owed): then it goes at once."""
    cache = MemoryCache(budget_tokens=10_000)
    priority = _priority(enabled=enabled)
    priority.account("C", 1000)  # takers are owed their share: not reserved, the steps merge
    batcher = StepBatcher(ComputeQueue(), priority=priority)
    with cache.open_session(1, 8) as taker, cache.open_session(1, 8) as contributor:
        await _both_wait_then_run(batcher, span, ("taker", taker), contributor)
        assert batcher.counters.merged_steps == 2
        priority.account("taker", 100_000)  # takers had their share: reserved from now on
        began = trio.current_time()
        await batcher.run(span, contributor, torch.randn(1, 1, 32), owner="C")
        waited = trio.current_time() - began
    if enabled:
        assert waited < GATHER_MIN_S
    else:
        assert waited >= GATHER_MIN_S


@pytest.mark.parametrize("enabled", [True, False], ids=["standing", "fifo"])
async def test_while_reserved_a_contributors_step_waits_little_for_its_own_partner(
    span: blocks.Span, autojump_clock: trio.testing.MockClock, enabled: bool
) -> None:
    """Two sessions of the contributor ran in one forward; the next step of one comes 0.4 s
    later, its partner's never does. It waits a quarter of its period (GATHER_MAX_S at most) on
    a free device for it, but while reserved only RESERVED_GATHER_S: a partner a takers' turn
    delayed on another hop would cost it that turn on every later hop too."""
    cache = MemoryCache(budget_tokens=10_000)
    priority = _priority(enabled=enabled)
    priority.account("someone", 1000)  # takers had their share lately
    batcher = StepBatcher(ComputeQueue(), priority=priority)
    with cache.open_session(1, 8) as first, cache.open_session(1, 8) as second:
        await _both_wait_then_run(batcher, span, ("C", first), second)
        assert batcher.counters.merged_steps == 2
        await trio.sleep(0.4)
        began = trio.current_time()
        await batcher.run(span, first, torch.randn(1, 1, 32), owner="C")
        waited = trio.current_time() - began
    if enabled:
        assert waited == pytest.approx(RESERVED_GATHER_S)
    else:
        assert waited == pytest.approx(GATHER_MAX_S)


def test_metrics_show_the_rests_imposed_on_takers() -> None:
    server = BlockServer(
        model=MODEL, start=0, end=1, compute=ComputeQueue(), peer_id="me", addrs=list
    )
    server.standing.num_blocks, server.standing.qualify_s = NUM_BLOCKS, 0
    server.standing.saw_serving("C", 10, 1.0)
    reservation = server.batcher.reservation
    assert reservation is not None
    reservation.priority.account("taker", 100)
    reservation.stepped("C", 10.0)
    reservation.taker_turn_ran(0.25, 10.5)
    text = render(_standing(server))
    assert "peerd_priority_taker_rests_total 1" in text
    assert f"peerd_priority_taker_rest_seconds_total {TAKER_REST * 0.25:g}" in text
    assert "peerd_priority_lane_turns_total 0" in text


async def test_each_class_s_steps_are_timed_in_wait_and_forward(
    span: blocks.Span, autojump_clock: trio.testing.MockClock
) -> None:
    """A contributor's decode step (one turn) and a taker's prefill (five turns of
    RESERVED_TURN_TOKENS, each 0.05 s on the turn timer): each class's step counted once, its
    forward time the sum of its turns, and the metrics say so per class and part."""
    server = BlockServer(
        model=MODEL, start=0, end=1, compute=ComputeQueue(), peer_id="me", addrs=list
    )
    server.standing.num_blocks, server.standing.qualify_s = NUM_BLOCKS, 0
    server.standing.saw_serving("C", 10, 1.0)
    assert server.batcher.priority is not None
    server.batcher.priority.account("someone", 1000)  # takers had their share lately
    batcher = StepBatcher(ComputeQueue(), priority=server.batcher.priority, timer=_Ticks(0.05))
    server.batcher = batcher
    cache = MemoryCache(budget_tokens=10_000)
    with cache.open_session(1, 256) as session, cache.open_session(1, 8) as other:
        await batcher.run(span, other, torch.randn(1, 1, 32), owner="C")
        await batcher.run(span, session, torch.randn(1, 5 * RESERVED_TURN_TOKENS, 32), "taker")
    contributor, taker = batcher.times["contributor"], batcher.times["taker"]
    assert (contributor.steps, taker.steps) == (1, 1)
    assert contributor.forward_s == pytest.approx(0.05)
    assert taker.forward_s == pytest.approx(5 * 0.05)
    assert contributor.wait_s >= 0 and taker.wait_s >= 0
    text = render(_standing(server))
    assert 'peerd_timed_steps_total{class="taker"} 1' in text
    assert f'peerd_step_seconds_total{{class="taker",part="forward"}} {5 * 0.05:g}' in text


class _Gated:
    """`span`, except that a forward on `held` waits for `gate` (and notes the nice value of the
    thread it runs in, and that it started)."""

    def __init__(self, span: blocks.Span, held: SpanSession) -> None:
        self.span, self.held = span, held
        self.device, self.chunk_tokens = span.device, span.chunk_tokens
        self.gate, self.started = threading.Event(), threading.Event()
        self.nice: list[int] = []

    def forward(
        self, hidden: torch.Tensor, session: SpanSession, adapter: str | None = None
    ) -> torch.Tensor:
        if session is self.held:
            self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            self.started.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return self.span.forward(hidden, session, adapter)


@pytest.mark.skipif(not lanes_supported(), reason="threads have no nice values of their own here")
async def test_while_reserved_a_takers_turn_runs_in_the_lane_and_a_contributor_goes_past_it(
    span: blocks.Span,
) -> None:
    """The contributor is active and a taker's turn is under way (held there by the test): the
    contributor's next step runs and returns meanwhile, in the compute queue's thread at normal
    priority, while the takers' turn runs in the lane at LANE_NICE. Both results are exact."""
    cache = MemoryCache(budget_tokens=10_000)
    priority = _priority()
    priority.account("someone", 1000)  # takers had their share lately
    batcher = StepBatcher(ComputeQueue(), priority=priority)
    x, y = torch.randn(1, 1, 32), torch.randn(1, 1, 32)
    with cache.open_session(1, 8) as ref_x, cache.open_session(1, 8) as ref_y:
        want_x, want_y = span(x, ref_x), span(y, ref_y)
    with (
        cache.open_session(1, 8) as taker,
        cache.open_session(1, 8) as contributor,
        cache.open_session(1, 8) as other,
    ):
        gated = _Gated(span, held=taker)
        span_ = cast(blocks.Span, gated)
        await batcher.run(span_, other, torch.randn(1, 1, 32), owner="C")  # C is active
        got: list[torch.Tensor] = []

        async def taker_step() -> None:
            got.append(await batcher.run(span_, taker, x, owner="taker"))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(taker_step)
                assert await trio.to_thread.run_sync(gated.started.wait, 60)
                mine = await batcher.run(span_, contributor, y, owner="C")
                assert not gated.gate.is_set() and not got  # the takers' turn is still held
                assert batcher.lane is not None and batcher.lane.jobs_done == 0
                gated.gate.set()
        finally:
            gated.gate.set()
    assert float((mine - want_y).abs().max()) <= 1e-5 * float(want_y.abs().max())
    assert float((got[0] - want_x).abs().max()) <= 1e-5 * float(want_x.abs().max())
    assert batcher.lane.niced is not None
    assert gated.nice == [LANE_NICE if batcher.lane.niced else 0]
    await _spin_until(lambda: batcher.lane is not None and batcher.lane.jobs_done == 1)
    assert batcher.counters.steps == 3


@pytest.mark.skipif(not lanes_supported(), reason="threads have no nice values of their own here")
async def test_a_takers_turn_in_the_lane_rests_for_its_cpu_time_not_its_wall_time(
    span: blocks.Span,
) -> None:
    """A takers' turn in the lane kept waiting (here by the test's gate; on a busy machine by
    the kernel, for the nice-0 threads) is charged its CPU time: the rest after it is TAKER_REST
    times what the lane's CPU clock (a stand-in moving 0.01 s a turn) says, not times the turn's
    wall time, which its step's forward time still counts."""
    cache = MemoryCache(budget_tokens=10_000)
    priority = _priority()
    priority.account("someone", 1000)  # takers had their share lately
    batcher = StepBatcher(ComputeQueue(), priority=priority, cpu_timer=_Ticks(0.01))
    assert batcher.reservation is not None
    held_s = 0.3
    with cache.open_session(1, 8) as taker, cache.open_session(1, 8) as contributor:
        gated = _Gated(span, held=taker)
        span_ = cast(blocks.Span, gated)
        await batcher.run(span_, contributor, torch.randn(1, 1, 32), owner="C")  # C is active
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(batcher.run, span_, taker, torch.randn(1, 1, 32), "taker")
                assert await trio.to_thread.run_sync(gated.started.wait, 60)
                await trio.sleep(held_s)
                gated.gate.set()
        finally:
            gated.gate.set()
    await _spin_until(lambda: batcher.lane is not None and batcher.lane.jobs_done == 1)
    assert batcher.reservation.rests == 1
    assert batcher.reservation.rested_s == pytest.approx(TAKER_REST * 0.01)
    assert batcher.times["taker"].forward_s >= held_s


async def test_fifo_runs_takers_turns_on_the_compute_queue_at_normal_priority(
    span: blocks.Span,
) -> None:
    cache = MemoryCache(budget_tokens=10_000)
    priority = _priority(enabled=False)
    priority.account("someone", 1000)
    batcher = StepBatcher(ComputeQueue(), priority=priority)
    with cache.open_session(1, 8) as taker, cache.open_session(1, 8) as contributor:
        gated = _Gated(span, held=taker)
        gated.gate.set()
        span_ = cast(blocks.Span, gated)
        await batcher.run(span_, contributor, torch.randn(1, 1, 32), owner="C")
        await batcher.run(span_, taker, torch.randn(1, 1, 32), owner="taker")
    assert gated.nice == [os.getpriority(os.PRIO_PROCESS, 0)]  # the process's own
    assert batcher.lane is None or batcher.lane.jobs_done == 0
