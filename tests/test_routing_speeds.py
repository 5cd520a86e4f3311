"""Self-reported throughput is believed only so far: routes against a lying record, the bounds of
routing.speeds, and StepSpeeds' measuring."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from routing.block_selection import better_span, choose_blocks
from routing.planner import plan_route
from routing.records import ServerRecord, ServerState
from routing.speeds import (
    MAX_BLOCK_STEPS_PER_S,
    MEASURED_SLACK,
    UNMEASURED_OVER_MEDIAN,
    StepSpeeds,
    credible_throughputs,
)
from tests.test_routing_fixtures import make_record, make_snapshot

LIE = 1e300  # what the security review's lying record announced


def _honest_and_liar() -> list[ServerRecord]:
    """Three honest servers of blocks 0:30 at 10 tokens/s and one that claims 1e300."""
    honest = [make_record(f"honest{i}", 0, 30, throughput=10.0) for i in range(3)]
    return [*honest, make_record("liar", 0, 30, throughput=LIE)]


def test_a_lying_record_does_not_take_every_training_route() -> None:
    snap = make_snapshot(30, *_honest_and_liar())
    rng = random.Random(7)
    firsts = Counter(plan_route(snap, mode="training", rng=rng)[0].peer_id for _ in range(1000))
    # Believed at 4 times the median, the liar weighs as much as 4 honest servers: 4/7 of the
    # routes, not 1000 of 1000 as before.
    assert firsts["liar"] < 700
    assert all(firsts[f"honest{i}"] > 60 for i in range(3))


def test_an_unmeasured_liar_beats_an_honest_server_by_no_more_than_the_cap() -> None:
    # honest0 costs 0.02 s of RTT + 0.1 s in its blocks; the liar 0.1 s of RTT and, believed,
    # nothing in its blocks: it used to win. Believed at 4 times the median (40 tokens/s), its
    # blocks cost 0.025 s and the honest server is cheaper.
    snap = make_snapshot(30, make_record("honest0", 0, 30), make_record("liar", 0, 30, LIE))
    route = plan_route(snap, rtts={"honest0": 0.02, "liar": 0.1})
    assert [hop.peer_id for hop in route] == ["honest0"]


def test_a_measured_liar_is_believed_no_more_than_what_it_ran() -> None:
    snap = make_snapshot(30, *_honest_and_liar())
    rtts = {peer: 0.05 for peer in snap.by_peer}
    # Before its first step the liar, like any fast server, wins at equal RTTs.
    assert [hop.peer_id for hop in plan_route(snap, rtts=rtts)] == ["liar"]
    # It ran our steps at a third of an honest server's speed per block (1/300 s per block).
    speeds = StepSpeeds()
    speeds.record("liar", blocks=30, tokens=1, seconds=0.3 + 0.05, rtt_s=0.05)
    assert speeds["liar"] == pytest.approx(0.01)
    route = plan_route(snap, rtts=rtts, measured=speeds)
    assert route[0].peer_id.startswith("honest")
    rng = random.Random(3)
    training = Counter(
        plan_route(snap, mode="training", rng=rng, measured=speeds)[0].peer_id for _ in range(1000)
    )
    # Believed at twice its measured speed (2/3 of an honest server): 2/11 of the routes.
    assert training["liar"] < 300


def test_credible_throughput_bounds() -> None:
    records = [*_honest_and_liar(), make_record("stalled", 0, 30, throughput=0.0)]
    believed = credible_throughputs(records)
    assert believed["honest0"] == 10.0  # at the median: as announced
    assert believed["liar"] == pytest.approx(UNMEASURED_OVER_MEDIAN * 10.0)
    assert believed["stalled"] == 0.0
    # Measured: min(announced, slack * measured), even above the unmeasured cap.
    fast = {"liar": 1 / 3000}  # measured at 100 tokens/s through 30 blocks
    assert credible_throughputs(records, fast)["liar"] == pytest.approx(MEASURED_SLACK * 100)
    # A measurement never raises a figure above what was announced.
    assert credible_throughputs(records, {"honest0": 1e-9})["honest0"] == 10.0


def test_speeds_compare_per_block_not_per_span() -> None:
    # A server of 30 blocks at 10 tokens/s runs each block as fast as one of 3 blocks at 100.
    records = [make_record("long", 0, 30, throughput=10.0), make_record("short", 0, 3, 100.0)]
    believed = credible_throughputs(records)
    assert believed == {"long": 10.0, "short": 100.0}


def test_a_swarm_of_liars_still_gets_a_finite_bound() -> None:
    liars = [make_record(f"liar{i}", 0, 30, throughput=LIE) for i in range(3)]
    believed = credible_throughputs(liars)
    assert all(t * 30 == pytest.approx(MAX_BLOCK_STEPS_PER_S) for t in believed.values())


def test_the_median_ignores_servers_routes_cannot_use() -> None:
    # Joining servers do not count: two joining liars cannot lift the median of one honest one.
    records = [
        make_record("honest", 0, 30, throughput=10.0),
        make_record("j1", 0, 30, throughput=LIE, state=ServerState.JOINING),
        make_record("j2", 0, 30, throughput=LIE, state=ServerState.JOINING),
        make_record("liar", 0, 30, throughput=LIE),
    ]
    assert credible_throughputs(records)["liar"] == pytest.approx(UNMEASURED_OVER_MEDIAN * 10.0)


def test_step_speeds_subtract_the_round_trip_and_smooth() -> None:
    speeds = StepSpeeds(alpha=0.5)
    assert speeds.record("a", blocks=10, tokens=1, seconds=0.15, rtt_s=0.05) == pytest.approx(0.01)
    # Two tokens in one step: seconds per token per block.
    assert speeds.record("a", blocks=10, tokens=2, seconds=0.65, rtt_s=0.05) == pytest.approx(
        0.5 * 0.01 + 0.5 * 0.03
    )
    assert set(speeds) == {"a"} and len(speeds) == 1


def test_a_step_hidden_by_the_round_trip_teaches_nothing() -> None:
    speeds = StepSpeeds()
    assert speeds.record("a", blocks=10, tokens=1, seconds=0.04, rtt_s=0.05) is None
    assert speeds.record("a", blocks=0, tokens=1, seconds=1.0) is None
    assert "a" not in speeds
    speeds.record("a", blocks=1, tokens=1, seconds=1.0)
    speeds.forget("a")
    assert "a" not in speeds


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0])
def test_step_speeds_refuse_nonsense(seconds: float) -> None:
    with pytest.raises(ValueError, match="seconds"):
        StepSpeeds().record("a", blocks=1, tokens=1, seconds=seconds)
    with pytest.raises(ValueError, match="alpha"):
        StepSpeeds(alpha=0.0)


def test_a_lying_record_does_not_empty_its_blocks_of_other_servers() -> None:
    # Blocks 0:10 held by three honest servers and a liar, 10:20 by three: the liar used to
    # make 0:10 look so well served that each honest server there moved away, one after the
    # other, leaving every route through 0:10 to the liar.
    records = [
        *(make_record(f"a{i}", 0, 10, throughput=10.0) for i in range(3)),
        *(make_record(f"b{i}", 10, 20, throughput=10.0) for i in range(3)),
        make_record("liar", 0, 10, throughput=LIE),
    ]
    snap = make_snapshot(20, *records)
    for _ in range(len(records)):  # let every server re-check until nobody moves
        for record in sorted(snap.records, key=lambda r: r.peer_id):
            if record.peer_id != "liar" and (span := better_span(snap, record)) is not None:
                snap = snap.with_record(dataclasses.replace(record, start=span[0], end=span[1]))
    honest_on_liars_blocks = [r for r in snap.records if r.start == 0 and r.peer_id != "liar"]
    assert honest_on_liars_blocks
    # ...and a new server joins the liar's blocks when they are held by the liar alone and
    # other blocks by fewer than 4 servers' worth more: it counts the liar as 4 median servers.
    alone = [make_record("liar", 0, 10, LIE)]
    alone += [make_record(f"b{i}", 10, 20, throughput=10.0) for i in range(6)]
    assert choose_blocks(make_snapshot(20, *alone), 10, 10.0) == (0, 10)
