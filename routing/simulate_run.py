"""One run of the simulated swarm (routing.simulate): N servers join, then for `periods` recheck
periods a share of them is replaced, half spread over the run and half at once (the servers of
blocks 20-49 go home, a region's volunteers at night), while clients find routes; the report
holds what `peerd bench scale` prints.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from routing.discovery import LANE_RECORDS
from routing.simulate import (
    LOAD_S,
    PUBLISH_PERIOD_S,
    RECHECK_PERIOD_S,
    ServerSpec,
    Swarm,
)
from routing.simulate_client import ClientRun, first_route

CLIENTS = 100
COVERAGE_EVERY_S = 10


def quantiles(values: list[float]) -> dict[str, float]:
    """Median, 90th percentile and maximum, rounded for a report."""
    if not values:
        return {}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "median": round(statistics.median(ordered), 4),
        "p90": round(p90, 4),
        "max": round(ordered[-1], 4),
    }


def run(
    peers: int,
    *,
    seed: int = 0,
    clients: int = CLIENTS,
    churn: float = 0.3,
    periods: float = 4.0,
    median_rtt_s: float = 0.05,
    lane_records: int = LANE_RECORDS,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Simulate `peers` servers and `clients` clients; return the report (a JSON-able map)."""
    if peers < 2 or clients < 1 or not 0 <= churn <= 1 or periods <= 0:
        raise ValueError("need peers >= 2, clients >= 1, 0 <= churn <= 1 and periods > 0")
    started = time.perf_counter()
    swarm = Swarm(peers, seed, median_rtt_s, lane_records)
    initial = [swarm.new_server() for _ in range(peers)]
    swarm.net.calibrate()
    for i, server in enumerate(initial):
        swarm.start_server(server)
        if (i + 1) % 2000 == 0:
            progress(f"{i + 1} of {peers} servers joined ({time.perf_counter() - started:.0f} s)")
    swarm.advance(LOAD_S + 1)
    progress(f"swarm built ({time.perf_counter() - started:.0f} s); churn and clients start")
    measured = _Measure(swarm, periods * RECHECK_PERIOD_S, progress)
    measured.go(churn, clients)
    report = measured.report()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def run_given(
    servers: Sequence[ServerSpec],
    clients: Sequence[float],
    *,
    num_blocks: int,
    seed: int = 0,
    settle_s: float = 60.0,
    client_gap_s: float = 10.0,
) -> dict[str, Any]:
    """The swarm of `servers` as given, joining in order, each choosing its span with
    `choose_blocks` and keeping it (no rebalancing, no churn); `settle_s` after they are online,
    one client per access delay in `clients`, `client_gap_s` apart, finds its first route. What
    `peerd bench scale --real` starts again as real daemons (the spans under "spans") to compare
    with. Per client under "clients" (None: it found no route)."""
    if not servers or not clients or num_blocks < 1:
        raise ValueError("need at least one server, one client and one block")
    swarm = Swarm(len(servers), seed, num_blocks=num_blocks, rebalance=False)
    joined = [swarm.new_server(spec) for spec in servers]
    for server in joined:
        swarm.start_server(server)
    swarm.advance(LOAD_S + settle_s)
    done: list[ClientRun | None] = []
    for i, access_s in enumerate(clients):
        done.append(first_route(swarm, f"client-{i}", access_s))
        swarm.advance(swarm.now + client_gap_s)
    routed = [c for c in done if c is not None]
    return {
        "spans": [list(s.record.span) if s.record else None for s in joined],
        "peer_ids": [s.peer_id for s in joined],
        "clients": [dataclasses.asdict(c) if c else None for c in done],
        "first_route_s": quantiles([c.first_route_s for c in routed]),
        "messages_per_lookup": round(
            sum(c.lookup_messages for c in routed) / (sum(c.lookups for c in routed) or 1), 2
        ),
        "lookups": quantiles([float(c.lookups) for c in routed]),
        "contacts": quantiles([float(c.contacts) for c in routed]),
        "bytes_per_plan": quantiles([float(c.bytes) for c in routed]),
        "cost_vs_optimum": quantiles([c.cost_ratio for c in routed]),
    }


class _Measure:
    def __init__(self, swarm: Swarm, span_s: float, progress: Callable[[str], None]) -> None:
        self.swarm, self.span_s, self.progress = swarm, span_s, progress
        self.t0 = swarm.now
        for peer in swarm.net.peers.values():
            peer.messages = peer.bytes = 0
        swarm.net.counts.clear()
        self.joined_at = {kid: self.t0 for kid in swarm.servers}
        self.coverage: list[tuple[float, int, float, float]] = []
        self.done: list[ClientRun] = []
        self.failed = 0
        self.burst_at = math.inf
        self.burst_left = 0

    def go(self, churn: float, clients: int) -> None:
        rng = self.swarm.rng
        spread = round(self.swarm.peers * churn / 2)
        actions = [(rng.uniform(0.05, 0.95) * self.span_s, "replace") for _ in range(spread)]
        actions.append((self.span_s / 3, "burst"))
        actions += [(rng.uniform(0.1, 1.0) * self.span_s, "client") for _ in range(clients)]
        actions += [(float(t), "sample") for t in range(0, int(self.span_s) + 1, COVERAGE_EVERY_S)]
        for at, kind in sorted(actions):
            self.swarm.advance(self.t0 + at)
            if kind == "replace":
                self.swarm.leave(rng.choice(list(self.swarm.servers)))
                self._join_later(0.0)
            elif kind == "burst":
                self._burst(round(self.swarm.peers * churn / 2))
                self.burst_at = at
            elif kind == "client":
                self._client()
            else:
                self._sample(at)

    def _join_later(self, delay: float) -> None:
        server = self.swarm.new_server()
        self.joined_at[server.kid] = self.swarm.now + delay
        if delay:
            self.swarm.schedule(delay, "join", server.kid)
        else:
            self.swarm.start_server(server)

    def _burst(self, count: int) -> None:
        """The servers whose spans start in blocks 20-49 leave at once (up to `count`); as many
        new ones join over the next publish period."""
        swarm = self.swarm
        going = [
            kid
            for kid, s in swarm.servers.items()
            if s.record is not None and 20 <= s.record.start < 50
        ]
        swarm.rng.shuffle(going)
        for kid in going[:count]:
            swarm.leave(kid)
        self.burst_left = len(going[:count])
        for _ in range(self.burst_left):
            self._join_later(swarm.rng.uniform(1.0, PUBLISH_PERIOD_S))

    def _client(self) -> None:
        result = first_route(self.swarm, f"client-{len(self.done) + self.failed}")
        if result is None:
            self.failed += 1
        else:
            self.done.append(result)
        if (len(self.done) + self.failed) % 25 == 0:
            self.progress(f"{len(self.done) + self.failed} clients routed")

    def _sample(self, at: float) -> None:
        throughputs, counts = self.swarm.truth().coverage()
        uncovered = sum(1 for c in counts if c == 0)
        self.coverage.append((at, uncovered, min(throughputs), max(throughputs)))

    def _upkeep(self) -> tuple[list[float], list[float]]:
        """Per live server, messages/s and bytes/s sent and received while it was in the run."""
        messages, size = [], []
        end = self.t0 + self.span_s
        for kid in self.swarm.servers:
            lived = end - self.joined_at.get(kid, end)
            if lived >= PUBLISH_PERIOD_S:
                peer = self.swarm.net.peers[kid]
                messages.append(peer.messages / lived)
                size.append(peer.bytes / lived)
        return messages, size

    def _recovery_s(self) -> float:
        """Seconds from the burst until every block was served again (inf: never)."""
        for at, uncovered, _, _ in self.coverage:
            if at >= self.burst_at and uncovered == 0:
                return at - self.burst_at
        return math.inf

    def _weakest_after_burst(self) -> float:
        """The weakest block's throughput 2 recheck periods after the burst, as a share of what
        it was just before (how far rebalancing healed the swarm; 1: fully)."""
        before = [mn for at, _, mn, _ in self.coverage if at < self.burst_at]
        after = [mn for at, _, mn, _ in self.coverage if at >= self.burst_at + 2 * RECHECK_PERIOD_S]
        if not before or not after or not before[-1]:
            return math.nan
        return round(after[0] / before[-1], 3)

    def report(self) -> dict[str, Any]:
        done, swarm = self.done, self.swarm
        messages, size = self._upkeep()
        lookups = sum(c.lookups for c in done) or 1
        recovery = self._recovery_s()
        ratios = [mn / mx if mx else 0.0 for _, _, mn, mx in self.coverage]
        return {
            "peers": swarm.peers,
            "blocks": swarm.num_blocks,
            "median_rtt_s": swarm.median_rtt_s,
            "simulated_s": self.span_s,
            "recheck_period_s": RECHECK_PERIOD_S,
            "clients": {"routed": len(done), "failed": self.failed},
            "first_route_s": quantiles([c.first_route_s for c in done]),
            "messages_to_first_route": quantiles([float(c.messages) for c in done]),
            "bytes_per_plan": quantiles([float(c.bytes) for c in done]),
            "messages_per_lookup": round(sum(c.lookup_messages for c in done) / lookups, 2),
            "hops_per_lookup": round(sum(c.lookup_hops for c in done) / lookups, 2),
            "contacts": quantiles([float(c.contacts) for c in done]),
            "cost_vs_optimum": quantiles([c.cost_ratio for c in done]),
            "coverage": {
                "samples_every_s": COVERAGE_EVERY_S,
                "samples_with_uncovered_blocks": sum(1 for _, u, _, _ in self.coverage if u),
                "min_over_max_block_throughput": quantiles(ratios) | {"min": round(min(ratios), 4)},
                "burst_at_s": round(self.burst_at, 1),
                "burst_left": self.burst_left,
                "covered_again_after_s": recovery,
                "covered_again_after_periods": round(recovery / RECHECK_PERIOD_S, 3),
                "weakest_block_2_periods_after_burst_vs_before": self._weakest_after_burst(),
                "series_t_uncovered_min_max": [
                    [round(at), u, round(mn, 1), round(mx, 1)]
                    for at, u, mn, mx in self.coverage[:: max(1, len(self.coverage) // 20)]
                ],
            },
            "upkeep_per_server": {
                "messages_per_s": quantiles(messages),
                "bytes_per_s": quantiles(size),
                "mean_bytes_per_s": round(statistics.fmean(size), 1) if size else 0.0,
            },
            "messages_by_kind": dict(swarm.net.counts),
            "live_servers_at_end": len(swarm.servers),
        }
