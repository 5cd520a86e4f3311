"""`peerd bench scale --real` without daemons (peerd.bench.scale_real): the swarm both sides run,
the simulator over given servers and clients, and the comparison of the figures they share."""

from __future__ import annotations

import itertools
import random

import pytest

from peerd.bench.scale_real import (
    AGREEMENT,
    SPAN_BLOCKS,
    Plan,
    compare,
    draw_plan,
    format_report,
    metric,
    parse_route,
    run_simulated,
    summarize_real,
)
from routing.netsim import Network
from routing.records import ServerRecord, SwarmSnapshot
from routing.simulate import Swarm
from wire import ServerState


def test_the_plan_draws_netsims_delays_scaled_to_the_median_round_trip() -> None:
    plan = draw_plan(12, 3, num_blocks=16, seed=4, median_rtt_s=0.05)
    assert plan == draw_plan(12, 3, num_blocks=16, seed=4, median_rtt_s=0.05)  # seeded
    assert plan != draw_plan(12, 3, num_blocks=16, seed=5, median_rtt_s=0.05)
    assert len(plan.servers) == 12 and len(plan.client_delays_s) == 3
    pairs = sorted(Plan.rtt(a, b) for a, b in itertools.combinations(plan.server_delays_s, 2))
    assert pairs[len(pairs) // 2] == pytest.approx(0.05)
    assert min(plan.server_delays_s + plan.client_delays_s) > 0
    assert len(set(plan.server_delays_s)) == 12  # drawn per peer (lognormal access delays)
    assert all(SPAN_BLOCKS[0] <= s.span_len <= SPAN_BLOCKS[1] for s in plan.servers)
    assert len({s.seed for s in plan.servers}) == 12
    with pytest.raises(ValueError, match="at least 2 servers"):
        draw_plan(1, 1)


def test_the_simulator_is_given_exactly_the_round_trips_the_namespaces_realise() -> None:
    plan = draw_plan(6, 1, num_blocks=12, seed=0)
    swarm = Swarm(6, num_blocks=12, rebalance=False)
    kids = [swarm.new_server(spec).kid for spec in plan.servers]
    for (i, a), (j, b) in itertools.combinations(enumerate(kids), 2):
        expected = Plan.rtt(plan.server_delays_s[i], plan.server_delays_s[j])
        assert swarm.net.rtt(a, b) == pytest.approx(expected)
    # A star: netsim's round trip is twice the sum of the access delays, whatever the draws.
    net = Network(random.Random(1))
    near, far = net.place("a", 0.01), net.place("b", 0.004, member=False)
    assert net.rtt(near.kid, far.kid) == pytest.approx(0.028)


def test_the_simulated_side_routes_every_client_over_spans_that_cover_the_model() -> None:
    plan = draw_plan(10, 3, num_blocks=12, seed=2)
    sim = run_simulated(plan, seed=2)
    assert len(sim["spans"]) == 10
    covered = set().union(*(range(a, b) for a, b in sim["spans"]))
    assert covered == set(range(12))
    assert [s.span_len for s in plan.servers] == [b - a for a, b in sim["spans"]]
    assert all(c is not None for c in sim["clients"])
    assert sim["first_route_s"]["median"] > 0
    assert sim["messages_per_lookup"] >= 2
    assert sim["cost_vs_optimum"]["median"] >= 1.0


def test_figures_agree_within_a_quarter_and_not_beyond() -> None:
    real = {"first_route_s": {"median": 0.4}, "messages_per_lookup": 6.0}
    sim = {"first_route_s": {"median": 0.3}, "messages_per_lookup": 7.6}
    real["cost_vs_optimum"] = sim["cost_vs_optimum"] = {"median": 1.0}
    result = compare(real, sim)
    figures = result["figures"]
    assert figures["first_route_s"] == {
        "real": 0.4,
        "sim": 0.3,
        "sim_over_real": 0.75,
        "agree": True,
    }
    assert figures["messages_per_lookup"]["agree"] is False  # 7.6 / 6 = 1.27
    assert result["agree"] is False
    assert compare(real | {"messages_per_lookup": 7.0}, sim)["agree"] is True
    report = {"servers": 24, "clients": 5, "blocks": 24, "median_rtt_s": 0.05, "wall_s": 300.0}
    text = format_report(report | {"comparison": result, "notes": ["a note"]})
    assert "messages_per_lookup: real 6.0, sim 7.6, sim/real 1.267 (DIFFER)" in text
    assert "first_route_s: real 0.4, sim 0.3, sim/real 0.75 (agree)" in text
    assert "note: a note" in text and text.endswith("within 25% on every figure: NO")
    # A figure the real swarm did not measure is not an agreement.
    missing = compare(real | {"first_route_s": {}}, sim)["figures"]["first_route_s"]
    assert missing["agree"] is False and missing["sim_over_real"] is None
    assert AGREEMENT == 0.25


def test_the_real_clients_are_summarised_as_the_simulator_reports() -> None:
    clients = [
        {"first_route_s": 0.5, "lookups": 5, "lookup_queries": 15, "cost_ratio": 1.0},
        {"first_route_s": 0.3, "lookups": 4, "lookup_queries": 9, "cost_ratio": 1.2},
        {"cost_ratio": 1.1},  # a client without discovery metrics: only its route cost
    ]
    real = summarize_real(clients)
    assert real["first_route_s"]["median"] == 0.4
    assert real["messages_per_lookup"] == round(2 * 24 / 9, 2)  # a query and its reply
    assert real["cost_vs_optimum"]["median"] == 1.1
    assert summarize_real([{"cost_ratio": 1.0}])["messages_per_lookup"] is None


def _record(peer_id: str, start: int, end: int) -> ServerRecord:
    return ServerRecord(
        peer_id=peer_id,
        model="tiny",
        start=start,
        end=end,
        throughput=10.0,
        free_cache_tokens=1024,
        state=ServerState.ONLINE,
        version="0.1.0",
    )


def test_a_route_the_local_api_lists_is_read_over_the_live_records() -> None:
    truth = SwarmSnapshot("tiny", 8, (_record("A", 0, 5), _record("B", 3, 8)))
    route = parse_route(("A[0:3)", "B[3:8)"), truth)
    assert [(h.peer_id, h.start, h.end) for h in route] == [("A", 0, 3), ("B", 3, 8)]
    assert route[1].record is truth.by_peer["B"]
    for bad in ("C[0:8)", "A[0:x)", "A"):
        with pytest.raises(ValueError, match="is not 'peer"):
            parse_route((bad,), truth)


def test_a_metric_is_read_labelled_or_not_and_absent_is_none() -> None:
    values = {"peerd_x 1": 0.0, "peerd_discovery_first_route_seconds": 0.7, 'peerd_y{m="a"}': 3.0}
    assert metric(values, "peerd_discovery_first_route_seconds") == 0.7
    assert metric(values, "peerd_y") == 3.0
    assert metric(values, "peerd_discovery_first_route") is None


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_small_real_swarm_is_measured_as_the_simulator_measures() -> None:
    from peerd.bench.scale_real import run_scale_real_bench
    from peerd.devtools import netns

    try:
        netns.check_available()
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))
    report = run_scale_real_bench(4, 1, num_blocks=8, seed=3, settle_s=12.0, progress=False)
    (client,) = report["real"]["clients"]
    # The daemons served the spans the simulated servers chose, and the client's route is over
    # them, charged against the optimum with the round trips the namespaces realise.
    assert not any("planned" in note for note in report["notes"]), report["notes"]
    assert client["route"] and client["cost_ratio"] >= 0.999
    assert 0.9 <= client["tcp_rtt_over_model"] <= 1.5, client  # the links realise the model
    if "first_route_s" in client:  # a daemon with discovery metrics (peerd/session/directory.py)
        assert 0 < client["first_route_s"] < 30 and client["lookups"] >= 1
        assert report["comparison"]["figures"]["first_route_s"]["sim_over_real"] is not None
    assert report["comparison"]["figures"]["cost_vs_optimum"]["real"] >= 0.999
