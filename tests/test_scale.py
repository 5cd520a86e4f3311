"""The simulated swarm behind `peerd bench scale` (routing.netsim, routing.simulate,
routing.simulate_run): Kademlia look-ups that find what they look for in O(log N) hops, and a
small swarm under churn where every client finds a route near the optimum."""

from __future__ import annotations

import math
import random

import pytest

from peerd.bench.scale import format_scale_report, run_scale_bench
from routing.netsim import ALPHA, DIAL_RTTS, STREAM_RTTS, Network
from routing.simulate_run import run


def test_a_clients_first_request_to_a_peer_dials_it_and_later_ones_reuse_the_connection() -> None:
    net = Network(random.Random(0))
    servers = [net.add(f"server-{i}") for i in range(3)]
    client = net.add("client", member=False)
    rtt = net.rtt(client.kid, servers[0].kid)
    transfer = net.transfer_s(client.kid, servers[0].kid, 100)
    first = net.exchange(client.kid, servers[0].kid, 40, 60, "info")
    assert first == pytest.approx((1 + STREAM_RTTS + DIAL_RTTS) * rtt + transfer)
    again = net.exchange(client.kid, servers[0].kid, 40, 60, "info")
    assert again == pytest.approx((1 + STREAM_RTTS) * rtt + transfer)
    assert net.measured_rtt(client.kid, servers[0].kid, 40, 60) == pytest.approx(rtt + transfer)
    net.remove(servers[0].kid)  # gone, then back under the same name: dialled again
    back = net.add("server-0")
    rtt = net.rtt(client.kid, back.kid)
    assert net.exchange(client.kid, back.kid, 40, 60, "info") > (1 + STREAM_RTTS + DIAL_RTTS) * rtt
    # A server's connections are not tracked (its upkeep is counted in messages and bytes).
    a, b = servers[1].kid, servers[2].kid
    assert net.exchange(a, b, 40, 60, "store") == net.exchange(a, b, 40, 60, "store")


def test_look_ups_find_the_closest_peers_in_few_hops_and_estimate_the_size() -> None:
    net = Network(random.Random(3))
    kids = [net.add(f"peer-{i}").kid for i in range(3000)]
    net.calibrate()
    rng = random.Random(4)
    hops, estimates = [], []
    for _ in range(40):
        origin, target = rng.choice(kids), rng.getrandbits(64)
        found = net.look_up(origin, target)
        truth = [kid for kid in net.closest(target, 3) if kid != origin]
        assert found.closest[:2] == truth[:2]  # the replicas a store or a read would use
        # A query goes to one of the ALPHA closest peers known when it is sent: a hop asks
        # ALPHA, and the answers of one can name closer peers while the others are on their way.
        assert found.messages % 2 == 0 and found.messages <= 2 * ALPHA * (found.hops + 2)
        hops.append(found.hops)
        estimates.append(net.estimate_size(found.closest, target))
    assert max(hops) <= math.ceil(math.log2(3000) / math.log2(ALPHA * 2))
    assert 1500 <= sorted(estimates)[len(estimates) // 2] <= 6000
    rtts = sorted(net.rtt(*rng.sample(kids, 2)) for _ in range(2000))
    assert 0.04 <= rtts[len(rtts) // 2] <= 0.06  # calibrated to a 50 ms median


def test_a_small_swarm_under_churn_routes_every_client_near_the_optimum() -> None:
    report = run(60, seed=1, clients=12, churn=0.3, periods=2.5)
    # Even where the records a client read leave a block to servers that left or are loading
    # (a 60-server swarm losing 30% of itself has few to spare), it reads more and routes.
    assert report["clients"] == {"routed": 12, "failed": 0}
    cost = report["cost_vs_optimum"]
    assert 0.95 <= cost["median"] <= 1.3, cost
    assert report["bytes_per_plan"]["max"] < 200_000
    assert report["contacts"]["max"] <= 24
    coverage = report["coverage"]
    assert coverage["burst_left"] > 0
    assert coverage["covered_again_after_periods"] <= 2.0
    upkeep = report["upkeep_per_server"]["bytes_per_s"]
    assert 0 < upkeep["median"] <= 1000
    assert report["live_servers_at_end"] == 60


def test_clients_of_a_few_hundred_servers_route_near_the_optimum_from_lanes() -> None:
    # Each client reads one shard and the lanes of the 2x2 cells around it: a fraction of the
    # swarm, yet the fastest servers near it, so its route is close to the one planned with
    # every server and every true RTT.
    report = run(400, seed=2, clients=20, churn=0.3, periods=1.5)
    assert report["clients"] == {"routed": 20, "failed": 0}
    assert report["cost_vs_optimum"]["median"] <= 1.10, report["cost_vs_optimum"]
    assert report["bytes_per_plan"]["max"] < 200_000
    assert report["contacts"]["max"] <= 24
    # Dials charged (routing.netsim): 2.7 s here; a join and a self look-up, a look-up and a
    # holders' read for the shard, the same for the lanes, the `info` calls, each new peer
    # dialled first.
    assert report["first_route_s"]["median"] <= 3.5
    assert report["messages_by_kind"]["store"] > 0


def test_the_bench_reports_each_size_against_its_targets() -> None:
    report = run_scale_bench([20], clients=3, periods=1.0, progress=False)
    assert [r["peers"] for r in report["runs"]] == [20]
    assert set(report["checks"][0]) == {
        "first_route_s",
        "bytes_per_plan",
        "cost_vs_optimum",
        "covered_again",
        "upkeep",
    }
    assert "20 peers: first route" in format_scale_report(report)
    with pytest.raises(ValueError, match="at least 2"):
        run_scale_bench([1], progress=False)
