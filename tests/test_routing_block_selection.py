"""Block selection: choose_blocks, better_span and their helpers on small exact swarms."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.block_selection import (
    better_span,
    blocks_that_fit,
    choose_blocks,
    first_to_move,
    recheck_delay,
    should_move,
)
from routing.records import SELECTION_STATES, ServerState, SwarmSnapshot
from routing.speeds import believed_snapshot
from tests.test_routing_fixtures import make_record, make_snapshot, relaxed, swarms


def test_empty_swarm_starts_at_block_zero() -> None:
    assert choose_blocks(make_snapshot(30), 10, 5.0) == (0, 10)


@pytest.mark.parametrize("state", [ServerState.JOINING, ServerState.ONLINE])
def test_three_servers_of_ten_blocks_cover_a_thirty_block_model(state: ServerState) -> None:
    """The daemon acceptance test starts three `--blocks auto` servers one after another."""
    snap = make_snapshot(30)
    spans = []
    for i in range(3):
        span = choose_blocks(snap, 10, own_throughput=5.0)
        spans.append(span)
        snap = snap.with_record(make_record(f"server{i}", *span, throughput=5.0, state=state))
    assert spans == [(0, 10), (10, 20), (20, 30)]
    assert snap.uncovered_blocks(states=SELECTION_STATES) == ()


def test_three_servers_cover_the_model_even_before_measuring_throughput() -> None:
    snap = make_snapshot(30)
    for i in range(3):
        span = choose_blocks(snap, 10, own_throughput=0.0)
        record = make_record(f"s{i}", *span, throughput=0.0, state=ServerState.JOINING)
        snap = snap.with_record(record)
    assert snap.uncovered_blocks(states=SELECTION_STATES) == ()


def test_fills_a_hole_in_the_middle() -> None:
    snap = make_snapshot(30, make_record("a", 0, 10), make_record("c", 20, 30))
    assert choose_blocks(snap, 10, 1.0) == (10, 20)
    assert choose_blocks(snap, 5, 1.0) == (10, 15)


def test_a_wide_server_covers_the_most_holes_it_can() -> None:
    snap = make_snapshot(30, make_record("a", 0, 10), make_record("c", 20, 24))
    # Windows starting at 10 to 14 each hold 12 of the 16 unserved blocks; the first one wins.
    assert choose_blocks(snap, 16, 1.0) == (10, 26)
    assert choose_blocks(snap, 20, 1.0) == (10, 30)


def test_prefers_the_least_served_blocks() -> None:
    snap = make_snapshot(
        30,
        make_record("a", 0, 10, throughput=10.0),
        make_record("b", 10, 20, throughput=5.0),
        make_record("c", 20, 30, throughput=20.0),
    )
    assert choose_blocks(snap, 10, 5.0) == (10, 20)
    # A narrower server goes to the first of the equally weak windows.
    assert choose_blocks(snap, 4, 5.0) == (10, 14)


def test_compares_whole_windows_not_just_their_weakest_block() -> None:
    # Blocks: 0-1 at 1, 2-3 at 3, 4-5 at 1, 6-7 at 2. Every window of 4 leaves a block at 1
    # outside it, so the bottleneck stays 1 whatever the choice; (4, 8) holds 1, 1, 2, 2, the
    # weakest set of blocks, where (0, 4) holds 1, 1, 3, 3.
    snap = make_snapshot(
        8,
        make_record("a", 0, 2, throughput=1.0),
        make_record("b", 2, 4, throughput=3.0),
        make_record("c", 4, 6, throughput=1.0),
        make_record("d", 6, 8, throughput=2.0),
    )
    assert choose_blocks(snap, 4, 1.0) == (4, 8)


def test_joining_servers_count_and_draining_ones_do_not() -> None:
    snap = make_snapshot(
        20,
        make_record("a", 0, 10, state=ServerState.JOINING),
        make_record("b", 10, 20, state=ServerState.DRAINING),
    )
    assert choose_blocks(snap, 10, 1.0) == (10, 20)


def test_a_real_hole_beats_a_block_held_by_a_stalled_server() -> None:
    snap = make_snapshot(
        20,
        make_record("a", 0, 10, throughput=0.0),
        make_record("b", 15, 20, throughput=50.0),
    )
    assert choose_blocks(snap, 5, 1.0) == (10, 15)


def test_asking_for_more_blocks_than_the_model_has_gets_the_whole_model() -> None:
    assert choose_blocks(make_snapshot(8, make_record("a", 0, 4)), 50, 1.0) == (0, 8)


@pytest.mark.parametrize(
    ("n", "own", "message"),
    [(0, 1.0, "num_blocks_to_serve must be >= 1"), (3, -1.0, "own_throughput")],
)
def test_choose_blocks_rejects_bad_arguments(n: int, own: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_blocks(make_snapshot(8), n, own)


def _holes(snap: SwarmSnapshot, span: tuple[int, int]) -> int:
    counts = snap.block_server_counts(states=SELECTION_STATES)
    return sum(1 for block in range(*span) if counts[block] == 0)


@relaxed
@given(swarms(), st.integers(1, 20), st.sampled_from([0.0, 1.0, 30.0]))
def test_choose_blocks_returns_a_valid_window_with_the_most_holes(
    snap: SwarmSnapshot, n: int, own: float
) -> None:
    start, end = choose_blocks(snap, n, own)
    assert 0 <= start < end <= snap.num_blocks
    assert end - start == min(n, snap.num_blocks)
    width = end - start
    best = max(_holes(snap, (s, s + width)) for s in range(snap.num_blocks - width + 1))
    assert _holes(snap, (start, end)) == best
    assert choose_blocks(snap, n, own) == (start, end)  # deterministic


# better_span ---------------------------------------------------------------------------------


def test_moves_off_a_doubly_held_span_into_a_hole() -> None:
    me = make_record("me", 0, 10)
    snap = make_snapshot(30, make_record("a", 0, 10), me, make_record("b", 10, 20))
    assert better_span(snap, me) == (20, 30)
    assert should_move(snap, me)


def test_stays_when_moving_would_only_open_a_hole_elsewhere() -> None:
    me = make_record("me", 0, 10)
    snap = make_snapshot(30, me, make_record("b", 10, 20))
    assert better_span(snap, me) is None


def test_stays_in_a_balanced_swarm() -> None:
    me = make_record("me", 0, 10)
    snap = make_snapshot(
        30, make_record("a", 0, 10), me, make_record("b", 10, 20), make_record("c", 20, 30)
    )
    assert better_span(snap, me) is None


def test_moves_to_a_clearly_weaker_span() -> None:
    me = make_record("me", 0, 10, throughput=10.0)
    snap = make_snapshot(
        30,
        make_record("a", 0, 10, throughput=10.0),
        me,
        make_record("b", 10, 20, throughput=3.0),
        make_record("c", 20, 30, throughput=10.0),
    )
    # Blocks 10-19 go from 3 to 13 tokens/s, blocks 0-9 from 20 to 10: weakest 3 -> 10.
    assert better_span(snap, me) == (10, 20)


def test_small_gains_are_not_worth_a_move() -> None:
    me = make_record("me", 0, 10, throughput=10.0)
    snap = make_snapshot(
        30,
        make_record("a", 0, 10, throughput=10.0),
        me,
        make_record("b", 10, 20, throughput=9.0),
        make_record("c", 20, 30, throughput=10.0),
    )
    # Weakest affected block: 9 now, 10 after; 10 / 9 < 1.2.
    assert better_span(snap, me) is None
    assert better_span(snap, me, min_improvement=1.05) == (10, 20)


def test_a_small_server_leaves_a_clear_surplus_for_a_deficit() -> None:
    me = make_record("me", 0, 10, throughput=1.0)

    def swarm(middle: float) -> SwarmSnapshot:
        return make_snapshot(
            30,
            make_record("a", 0, 10, throughput=100.0),
            me,
            make_record("b", 10, 20, throughput=middle),
            make_record("c", 20, 30, throughput=100.0),
        )

    # Moving lifts blocks 10-19 only from 50 to 51, but blocks 0-9 keep 100, about twice that.
    assert better_span(swarm(50.0), me) == (10, 20)
    # 100 against 91 is no clear surplus, and 90 -> 91 no clear gain.
    assert better_span(swarm(90.0), me) is None


def test_a_server_that_has_not_measured_its_throughput_moves_only_to_fill_holes() -> None:
    me = make_record("me", 0, 10, throughput=0.0)
    lopsided = make_snapshot(
        20, make_record("a", 0, 10, throughput=100.0), me, make_record("b", 10, 20, throughput=1.0)
    )
    assert better_span(lopsided, me) is None
    holed = make_snapshot(20, make_record("a", 0, 10, throughput=100.0), me)
    assert better_span(holed, me) == (10, 20)


def test_uses_my_record_over_a_stale_one_in_the_snapshot() -> None:
    me_now = make_record("me", 0, 10)
    snap = make_snapshot(
        30, make_record("a", 0, 10), make_record("me", 20, 30), make_record("b", 10, 20)
    )
    assert better_span(snap, me_now) == (20, 30)


def test_better_span_rejects_thresholds_below_one() -> None:
    me = make_record("me", 0, 10)
    with pytest.raises(ValueError, match="min_improvement"):
        better_span(make_snapshot(30, me), me, min_improvement=0.5)


def _potential(snap: SwarmSnapshot) -> tuple[int, tuple[float, ...]]:
    """What every move must improve: fewer holes, then a better sorted per-block capacity, at
    the throughputs selection believes (moves change no throughput, so neither that belief)."""
    throughputs = believed_snapshot(snap).block_throughputs(states=SELECTION_STATES)
    # Believed figures are rarely exact in binary: sums in another order differ in the last bits
    # (and leave crumbs like 4e-16 on blocks held only by zero-throughput servers).
    rounded = (round(t, 9) for t in throughputs)
    return (-len(snap.uncovered_blocks(states=SELECTION_STATES)), tuple(sorted(rounded)))


@relaxed
@given(swarms(max_blocks=12, max_servers=10), st.sampled_from([1.0, 1.2, 2.0]))
def test_moves_always_improve_the_swarm_and_settle(snap: SwarmSnapshot, threshold: float) -> None:
    for _ in range(200):
        moved = False
        for record in snap.records:
            if record.state not in SELECTION_STATES:
                continue
            span = better_span(snap, record, min_improvement=threshold)
            if span is None:
                continue
            assert span != record.span
            before = _potential(snap)
            # A move changes the span only (state and throughput stay, so does the median
            # speed that selection believes figures against).
            snap = snap.with_record(dataclasses.replace(record, start=span[0], end=span[1]))
            assert _potential(snap) > before
            moved = True
        if not moved:
            return
    pytest.fail("servers kept moving for 200 rounds")


# helpers -------------------------------------------------------------------------------------


def test_recheck_delay_jitters_within_bounds_and_is_reproducible() -> None:
    delays = [recheck_delay(random.Random(7), 100.0) for _ in range(3)]
    assert delays[0] == delays[1] == delays[2]
    rng = random.Random(1)
    samples = [recheck_delay(rng, 100.0, jitter=0.5) for _ in range(1000)]
    assert all(50.0 <= d <= 150.0 for d in samples)
    assert min(samples) < 60.0 and max(samples) > 140.0
    assert recheck_delay(rng, 100.0, jitter=0.0) == 100.0


@pytest.mark.parametrize(("period", "jitter"), [(0.0, 0.5), (-1.0, 0.5), (10.0, 1.0), (10.0, -0.1)])
def test_recheck_delay_rejects_bad_arguments(period: float, jitter: float) -> None:
    with pytest.raises(ValueError):
        recheck_delay(random.Random(0), period, jitter=jitter)


@pytest.mark.parametrize(
    ("budget", "weights", "cache", "num_blocks", "expected"),
    [
        (1000, 100, 0, 30, 10),
        (1000, 90, 10, 30, 10),
        (999, 90, 10, 30, 9),
        (10_000, 100, 0, 30, 30),
        (50, 100, 0, 30, 0),
        (0, 100, 10, 30, 0),
    ],
)
def test_blocks_that_fit(
    budget: int, weights: int, cache: int, num_blocks: int, expected: int
) -> None:
    assert blocks_that_fit(budget, weights, cache, num_blocks) == expected


@pytest.mark.parametrize(
    "args", [(-1, 100, 0, 30), (1000, 0, 0, 30), (1000, 100, -1, 30), (1000, 100, 0, 0)]
)
def test_blocks_that_fit_rejects_bad_arguments(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        blocks_that_fit(*args)


def test_of_two_servers_that_would_fill_the_same_gap_only_the_first_moves() -> None:
    # The middle server died: both servers of 0:10 would move to 10:20. Were both to move, 0:10
    # would be empty and both would move back (their moves show only after they decide).
    one, two = make_record("p1", 0, 10), make_record("p2", 0, 10)
    snap = make_snapshot(30, one, two, make_record("c", 20, 30))
    assert better_span(snap, one) == better_span(snap, two) == (10, 20)
    assert first_to_move(snap, one, (10, 20)) == "p1"
    assert first_to_move(snap, two, (10, 20)) == "p1"
    # Once p1's move shows (joining 10:20), p2 has nothing to fill.
    moved = make_snapshot(
        30, make_record("p1", 10, 20, state=ServerState.JOINING), two, make_record("c", 20, 30)
    )
    assert better_span(moved, two) is None
    # A server of another span, or one not online, is not waited for.
    draining = dataclasses.replace(one, state=ServerState.DRAINING)
    alone = make_snapshot(30, draining, two, make_record("c", 20, 30))
    assert first_to_move(alone, two, (10, 20)) == "p2"
