"""Route planning: exact routes on small swarms, failures, and properties on random ones."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.bans import BanList
from routing.planner import (
    DEFAULT_RTT_S,
    NoRouteError,
    Route,
    RouteHop,
    format_route,
    hop_cost,
    plan_route,
    replan_from,
    route_cost,
)
from routing.records import ServerState, SwarmSnapshot
from routing.speeds import credible_throughputs
from tests.test_routing_fixtures import make_record, make_snapshot, relaxed, swarms


def spans(route: Route) -> list[tuple[str, int, int]]:
    return [(hop.peer_id, hop.start, hop.end) for hop in route]


def test_one_server_holding_everything_is_one_hop() -> None:
    record = make_record("a", 0, 30)
    route = plan_route(make_snapshot(30, record))
    assert route == (RouteHop("a", 0, 30, record),)


def test_chains_servers_in_block_order() -> None:
    snap = make_snapshot(
        30, make_record("c", 20, 30), make_record("a", 0, 10), make_record("b", 10, 20)
    )
    assert spans(plan_route(snap)) == [("a", 0, 10), ("b", 10, 20), ("c", 20, 30)]


def test_prefers_the_nearer_server() -> None:
    snap = make_snapshot(10, make_record("far", 0, 10), make_record("near", 0, 10))
    assert spans(plan_route(snap, rtts={"far": 0.3, "near": 0.02})) == [("near", 0, 10)]


def test_an_unmeasured_peer_costs_the_default_rtt() -> None:
    snap = make_snapshot(10, make_record("measured", 0, 10), make_record("unknown", 0, 10))
    assert spans(plan_route(snap, rtts={"measured": 0.2})) == [("unknown", 0, 10)]
    assert spans(plan_route(snap, rtts={"measured": 0.2}, default_rtt_s=0.5)) == [
        ("measured", 0, 10)
    ]


def test_prefers_the_faster_server_at_equal_rtt() -> None:
    snap = make_snapshot(
        10, make_record("slow", 0, 10, throughput=5.0), make_record("fast", 0, 10, throughput=50.0)
    )
    assert spans(plan_route(snap)) == [("fast", 0, 10)]


def test_relayed_servers_pay_a_penalty() -> None:
    snap = make_snapshot(
        10,
        make_record("a-relayed", 0, 10, throughput=20.0, relayed=True),
        make_record("b-direct", 0, 10, throughput=10.0),
    )
    # Compute: 0.05 s on a-relayed, 0.1 s on b-direct; the relay costs more than it saves.
    assert spans(plan_route(snap, relayed_penalty_s=0.1)) == [("b-direct", 0, 10)]
    assert spans(plan_route(snap, relayed_penalty_s=0.01)) == [("a-relayed", 0, 10)]


def test_a_fast_server_takes_over_mid_span_when_it_pays() -> None:
    snap = make_snapshot(
        30, make_record("big", 0, 30, throughput=1.0), make_record("fast", 10, 20, throughput=100.0)
    )
    # Whole span on big: 0.05 + 30/30 = 1.05 s. Detour: 2 * (0.05 + 10/30) + (0.05 + 10/1000).
    route = plan_route(snap)
    assert spans(route) == [("big", 0, 10), ("fast", 10, 20), ("big", 20, 30)]
    assert route_cost(route, rtts={}) == pytest.approx(2 * (0.05 + 1 / 3) + 0.06)
    # With a slow link to fast, one long hop is cheaper.
    assert spans(plan_route(snap, rtts={"fast": 1.0})) == [("big", 0, 30)]


def test_equal_cost_chains_take_fewer_hops() -> None:
    snap = make_snapshot(
        20,
        make_record("a", 0, 10, throughput=20.0),
        make_record("b", 10, 20, throughput=20.0),
        make_record("whole", 0, 20, throughput=10.0),
    )
    # Every block costs 1/200 s anywhere and RTTs are zero: the split route costs the same.
    zero = {"a": 0.0, "b": 0.0, "whole": 0.0}
    assert spans(plan_route(snap, rtts=zero)) == [("whole", 0, 20)]


def test_routes_a_sub_range_of_the_model() -> None:
    snap = make_snapshot(30, make_record("a", 0, 10), make_record("b", 10, 20))
    assert spans(plan_route(snap, 5, 15)) == [("a", 5, 10), ("b", 10, 15)]
    assert spans(plan_route(snap, 12, 13)) == [("b", 12, 13)]
    assert plan_route(snap, 7, 7) == ()


@pytest.mark.parametrize("state", [ServerState.JOINING, ServerState.DRAINING])
def test_skips_servers_that_are_not_online(state: ServerState) -> None:
    snap = make_snapshot(
        10, make_record("a", 0, 10, throughput=1000.0, state=state), make_record("b", 0, 10)
    )
    assert spans(plan_route(snap)) == [("b", 0, 10)]


def test_skips_banned_blocked_and_unlisted_servers() -> None:
    snap = make_snapshot(
        10,
        make_record("a", 0, 10, throughput=40.0),
        make_record("b", 0, 10, throughput=30.0),
        make_record("c", 0, 10, throughput=20.0),
        make_record("d", 0, 10, throughput=10.0),
    )
    assert spans(plan_route(snap)) == [("a", 0, 10)]
    assert spans(plan_route(snap, bans={"a"})) == [("b", 0, 10)]
    assert spans(plan_route(snap, blocked_servers={"a", "b"})) == [("c", 0, 10)]
    assert spans(plan_route(snap, allowed_servers={"c", "d"}, bans={"c"})) == [("d", 0, 10)]


def test_asks_a_ban_list_at_now() -> None:
    snap = make_snapshot(10, make_record("a", 0, 10, throughput=40.0), make_record("b", 0, 10))
    bans = BanList(base_s=1.0)
    bans.record_failure("a", now=100.0)
    assert spans(plan_route(snap, bans=bans, now=100.5)) == [("b", 0, 10)]
    assert spans(plan_route(snap, bans=bans, now=101.0)) == [("a", 0, 10)]
    with pytest.raises(ValueError, match="needs `now`"):
        plan_route(snap, bans=bans)


def test_skips_expired_records_when_given_now() -> None:
    snap = make_snapshot(
        10, make_record("a", 0, 10, throughput=40.0, expires_at=50.0), make_record("b", 0, 10)
    )
    assert spans(plan_route(snap, now=49.0)) == [("a", 0, 10)]
    assert spans(plan_route(snap, now=50.0)) == [("b", 0, 10)]


def test_inference_needs_free_cache_and_training_does_not() -> None:
    snap = make_snapshot(
        10,
        make_record("full", 0, 10, throughput=40.0, free_cache_tokens=10),
        make_record("roomy", 0, 10, throughput=1.0, free_cache_tokens=5000),
    )
    assert spans(plan_route(snap, min_free_cache_tokens=2048)) == [("roomy", 0, 10)]
    assert spans(plan_route(snap, min_free_cache_tokens=10)) == [("full", 0, 10)]
    rng = random.Random(0)
    chosen = {
        plan_route(snap, mode="training", min_free_cache_tokens=2048, rng=rng)[0].peer_id
        for _ in range(50)
    }
    assert chosen == {"full", "roomy"}


def test_inference_skips_servers_whose_sessions_are_too_short() -> None:
    snap = make_snapshot(
        10,
        make_record("short", 0, 10, throughput=40.0, max_session_length=512),
        make_record("long", 0, 10, throughput=1.0, max_session_length=8192),
        make_record("unannounced", 0, 10, throughput=0.5),
    )
    assert spans(plan_route(snap, session_length=512)) == [("short", 0, 10)]
    assert spans(plan_route(snap, session_length=2048)) == [("long", 0, 10)]
    only_short = make_snapshot(10, make_record("short", 0, 10, max_session_length=512))
    with pytest.raises(NoRouteError, match="sessions too short"):
        plan_route(only_short, session_length=513)


def test_avoids_stalled_servers_but_uses_one_rather_than_fail() -> None:
    stalled = make_record("stalled", 0, 10, throughput=0.0)
    snap = make_snapshot(10, stalled, make_record("slow", 0, 10, throughput=0.001))
    assert spans(plan_route(snap)) == [("slow", 0, 10)]
    assert spans(plan_route(make_snapshot(10, stalled))) == [("stalled", 0, 10)]


# errors --------------------------------------------------------------------------------------


def test_no_route_names_the_missing_blocks_and_the_fix() -> None:
    snap = make_snapshot(30, make_record("a", 0, 12), make_record("b", 18, 30))
    with pytest.raises(NoRouteError) as info:
        plan_route(snap)
    assert str(info.value) == (
        "no peer serves blocks 12-17 of smollm2-135m: start one with `peerd start --blocks 12:18`"
    )
    assert info.value.missing == ((12, 18),)
    assert info.value.skipped == {}


def test_no_route_lists_every_gap() -> None:
    snap = make_snapshot(30, make_record("a", 0, 3), make_record("b", 4, 20))
    with pytest.raises(NoRouteError) as info:
        plan_route(snap)
    assert str(info.value) == (
        "no peer serves block 3 and blocks 20-29 of smollm2-135m: start them with "
        "`peerd start --blocks 3:4` and `peerd start --blocks 20:30`"
    )


def test_no_route_says_why_holders_were_skipped() -> None:
    snap = make_snapshot(
        20,
        make_record("a", 0, 20, state=ServerState.DRAINING),
        make_record("b", 0, 10),
        make_record("c", 10, 20, free_cache_tokens=0),
        make_record("d", 5, 15, state=ServerState.JOINING),
    )
    with pytest.raises(NoRouteError) as info:
        plan_route(snap, bans={"b"}, min_free_cache_tokens=1)
    assert info.value.missing == ((0, 20),)
    assert info.value.skipped == {
        "a": "draining",
        "b": "banned after failures",
        "c": "out of cache",
        "d": "joining",
    }
    assert str(info.value) == (
        "no usable peer serves blocks 0-19 of smollm2-135m (4 peers hold them but are skipped: "
        "1 banned after failures, 1 draining, 1 joining, 1 out of cache): try again shortly, "
        "or start one with `peerd start --blocks 0:20`"
    )


def test_no_route_mentions_only_holders_of_the_missing_blocks() -> None:
    snap = make_snapshot(
        20, make_record("a", 0, 10), make_record("b", 0, 10), make_record("c", 10, 20)
    )
    with pytest.raises(NoRouteError) as info:
        plan_route(snap, blocked_servers={"b", "c"})
    assert info.value.skipped == {"c": "blocked"}
    assert "1 peer holds them but is skipped: 1 blocked" in str(info.value)


def test_allowed_servers_that_leave_blocks_uncovered_say_so_at_once() -> None:
    snap = make_snapshot(
        30, make_record("a", 0, 15), make_record("b", 15, 30), make_record("c", 0, 30)
    )
    route = plan_route(snap, allowed_servers={"a", "b"})
    assert [(h.peer_id, h.start, h.end) for h in route] == [("a", 0, 15), ("b", 15, 30)]
    with pytest.raises(NoRouteError) as info:
        plan_route(snap, allowed_servers={"a", "ghost"})
    assert info.value.missing == ((15, 30),)
    assert info.value.due_to_allowed_servers
    assert info.value.absent_allowed == ("ghost",)
    assert str(info.value) == (
        "allowed_servers leave blocks 15-29 of smollm2-135m uncovered: no allowed server holds "
        "them, only b, c; ghost is not in the swarm. Add a server that holds them to "
        "allowed_servers, or drop allowed_servers"
    )
    # A holder that is merely draining is not the allowed list's fault: the usual message.
    snap = make_snapshot(30, make_record("a", 0, 30, state=ServerState.DRAINING))
    with pytest.raises(NoRouteError) as info:
        plan_route(snap, allowed_servers={"a"})
    assert not info.value.due_to_allowed_servers
    assert "1 draining" in str(info.value)


@pytest.mark.parametrize(("start", "end"), [(-1, 5), (5, 4), (0, 31)])
def test_rejects_ranges_outside_the_model(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="cannot route blocks"):
        plan_route(make_snapshot(30, make_record("a", 0, 30)), start, end)


def test_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        plan_route(make_snapshot(30, make_record("a", 0, 30)), mode="backward")  # type: ignore[arg-type]


# training ------------------------------------------------------------------------------------


def test_training_spreads_load_by_throughput() -> None:
    snap = make_snapshot(
        20,
        # a runs each block 3 times as fast as b or c: within what routing.speeds believes
        # of a server never measured.
        make_record("a", 0, 20, throughput=15.0),
        make_record("b", 0, 10, throughput=10.0),
        make_record("c", 10, 20, throughput=10.0),
    )
    rng = random.Random(1234)
    firsts = Counter(plan_route(snap, mode="training", rng=rng)[0].peer_id for _ in range(4000))
    assert firsts["a"] / 4000 == pytest.approx(0.6, abs=0.03)
    # A hop runs to the end of the chosen server's span.
    route = plan_route(snap, mode="training", rng=random.Random(5))
    assert all(hop.end == min(hop.record.end, 20) for hop in route)


def test_training_is_reproducible_with_a_seeded_rng() -> None:
    snap = make_snapshot(
        20, *(make_record(f"p{i}", i, min(20, i + 7), throughput=1.0 + i) for i in range(20))
    )
    first = plan_route(snap, mode="training", rng=random.Random(99))
    again = plan_route(snap, mode="training", rng=random.Random(99))
    assert first == again


def test_training_uses_stalled_servers_only_when_nothing_else_holds_the_block() -> None:
    snap = make_snapshot(
        10,
        make_record("stalled", 0, 10, throughput=0.0),
        make_record("live", 0, 5, throughput=1.0),
    )
    route = plan_route(snap, mode="training", rng=random.Random(0))
    assert spans(route) == [("live", 0, 5), ("stalled", 5, 10)]


# replan_from ---------------------------------------------------------------------------------


def test_replan_replaces_the_failed_hop_with_several() -> None:
    snap = make_snapshot(
        30,
        make_record("a", 0, 10),
        make_record("b", 10, 20, throughput=100.0),
        make_record("c", 20, 30),
        make_record("b1", 10, 15),
        make_record("b2", 15, 20),
    )
    route = plan_route(snap)
    assert spans(route) == [("a", 0, 10), ("b", 10, 20), ("c", 20, 30)]
    new = replan_from(snap, route, "b")
    assert spans(new) == [("a", 0, 10), ("b1", 10, 15), ("b2", 15, 20), ("c", 20, 30)]
    assert new[0] is route[0] and new[-1] is route[-1]


def test_an_adapter_route_uses_only_servers_that_list_it() -> None:
    snap = make_snapshot(
        30,
        make_record("fast", 0, 30, throughput=1000.0),  # the plain route's choice
        make_record("a", 0, 12, adapters=("shout", "calm")),
        make_record("b", 12, 30, adapters=("shout",)),
        make_record("c", 10, 30, throughput=500.0, adapters=("calm",)),
    )
    assert spans(plan_route(snap)) == [("fast", 0, 30)]
    assert spans(plan_route(snap, adapter="shout")) == [("a", 0, 12), ("b", 12, 30)]
    assert spans(plan_route(snap, adapter="calm")) == [("a", 0, 10), ("c", 10, 30)]
    for mode in ("inference", "training"):
        route = plan_route(snap, adapter="shout", mode=mode, rng=random.Random(1))
        assert all("shout" in hop.record.adapters for hop in route)
    route = plan_route(snap, adapter="shout")
    with pytest.raises(NoRouteError) as e:
        replan_from(snap, route, "b", adapter="shout")
    assert e.value.missing == ((12, 30),)
    assert "without adapter shout" in str(e.value) and "--adapters DIR" in str(e.value)
    with pytest.raises(NoRouteError, match="3 without adapter other"):
        plan_route(snap.without("fast"), adapter="other")


def test_replan_fails_clearly_when_nobody_else_holds_the_blocks() -> None:
    snap = make_snapshot(30, make_record("a", 0, 10), make_record("b", 10, 30))
    route = plan_route(snap)
    with pytest.raises(NoRouteError, match="blocks 10-29") as info:
        replan_from(snap, route, "b")
    assert info.value.skipped == {"b": "blocked"}


def test_replan_needs_the_failed_peer_on_the_route() -> None:
    snap = make_snapshot(30, make_record("a", 0, 30))
    with pytest.raises(ValueError, match="peer 'zzz' is not on the route a\\[0:30\\)"):
        replan_from(snap, plan_route(snap), "zzz")


def test_cost_helpers_and_format() -> None:
    record = make_record("a", 0, 10, throughput=10.0, relayed=True)
    assert hop_cost(record, 0, 5, rtt_s=0.1, relayed_penalty_s=0.2) == pytest.approx(0.35)
    route = (RouteHop("a", 0, 5, record), RouteHop("a", 5, 10, record))
    assert route_cost(route, rtts={}, relayed_penalty_s=0.0) == pytest.approx(
        2 * DEFAULT_RTT_S + 0.1
    )
    assert format_route(route) == "a[0:5) -> a[5:10)"
    assert format_route(()) == "(empty)"


# properties ----------------------------------------------------------------------------------


def _usable(snap: SwarmSnapshot, peer: str, mode: str, banned: set[str], blocked: set[str]) -> bool:
    record = snap.record(peer)
    assert record is not None
    return (
        record.state is ServerState.ONLINE
        and peer not in banned
        and peer not in blocked
        and (mode == "training" or record.free_cache_tokens >= 100)
    )


@settings(relaxed, max_examples=300)
@given(
    swarms(),
    st.data(),
    st.sampled_from(["inference", "training"]),
    st.randoms(use_true_random=False),
)
def test_routes_are_contiguous_exact_and_use_only_usable_peers(
    snap: SwarmSnapshot, data: st.DataObject, mode: str, rng: random.Random
) -> None:
    start = data.draw(st.integers(0, snap.num_blocks - 1))
    end = data.draw(st.integers(start + 1, snap.num_blocks))
    peers = sorted(snap.by_peer)
    banned = set(data.draw(st.lists(st.sampled_from(peers), max_size=3))) if peers else set()
    blocked = set(data.draw(st.lists(st.sampled_from(peers), max_size=2))) if peers else set()
    try:
        route = plan_route(
            snap,
            start,
            end,
            bans=banned,
            blocked_servers=blocked,
            min_free_cache_tokens=100,
            mode=mode,  # type: ignore[arg-type]
            rng=rng,
        )
    except NoRouteError as error:
        assert error.missing
        for a, b in error.missing:
            assert start <= a < b <= end
            for block in range(a, b):
                holders = snap.servers_covering(block)
                assert not any(_usable(snap, r.peer_id, mode, banned, blocked) for r in holders)
        return
    position = start
    for hop in route:
        assert hop.start == position < hop.end
        assert hop.record == snap.record(hop.peer_id)
        assert hop.record.start <= hop.start and hop.end <= hop.record.end
        assert _usable(snap, hop.peer_id, mode, banned, blocked)
        position = hop.end
    assert position == end
    assert all(a.peer_id != b.peer_id for a, b in itertools.pairwise(route))


def _cheapest_cost_by_brute_force(
    snap: SwarmSnapshot, start: int, end: int, rtts: dict[str, float]
) -> float:
    """Cheapest cost over every chain of sub-span hops, by plain dynamic programming, at the
    throughputs the planner believes."""
    believed = credible_throughputs(snap.records)
    best = [math.inf] * (end + 1)
    best[start] = 0.0
    for q in range(start + 1, end + 1):
        for p in range(start, q):
            for r in snap.records:
                if r.state is ServerState.ONLINE and r.start <= p and q <= r.end:
                    rtt_s = rtts.get(r.peer_id, DEFAULT_RTT_S)
                    cost = hop_cost(r, p, q, rtt_s=rtt_s, throughput=believed[r.peer_id])
                    best[q] = min(best[q], best[p] + cost)
    return best[end]


@settings(relaxed, max_examples=300)
@given(swarms(max_blocks=10, max_servers=8), st.data())
def test_inference_routes_are_the_cheapest(snap: SwarmSnapshot, data: st.DataObject) -> None:
    # Zero-throughput servers cost infinity per block; the planner's handling of them is pinned
    # by its own test, here every server computes.
    snap = dataclasses.replace(
        snap,
        records=tuple(dataclasses.replace(r, throughput=r.throughput or 1.0) for r in snap.records),
    )
    start = data.draw(st.integers(0, snap.num_blocks - 1))
    end = data.draw(st.integers(start + 1, snap.num_blocks))
    rtts = {
        peer: data.draw(st.sampled_from([0.0, 0.01, 0.2, 1.0])) for peer in sorted(snap.by_peer)
    }
    expected = _cheapest_cost_by_brute_force(snap, start, end, rtts)
    try:
        route = plan_route(snap, start, end, rtts=rtts)
    except NoRouteError:
        assert expected == math.inf
        return
    believed = credible_throughputs(snap.records)
    cost = route_cost(route, rtts=rtts, throughputs=believed)
    assert cost == pytest.approx(expected, rel=1e-6, abs=1e-6)
