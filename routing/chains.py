"""How a route is chosen once each block's usable holders are known (routing.planner decides who
is usable): the cheapest chain of hops for inference, a throughput-weighted spread for training.

The cheapest chain is Dijkstra over block boundaries, with a node per (server, boundary) inside a
span so that leaving a server early is an ordinary edge; hop costs are the planner's (see
routing.planner). Among equally cheap chains it takes the one with fewer hops; blocks on servers
reporting zero throughput are avoided before anything else.

Both take each server's throughput from `throughputs` (peer_id -> tokens/s), the figure routing
believes (routing.speeds), falling back to the record's own for a peer it lacks.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from routing.records import ServerRecord


@dataclass(frozen=True)
class RouteHop:
    """Run blocks [start, end) on `peer_id`; `record` is what the planner knew of it."""

    peer_id: str
    start: int
    end: int
    record: ServerRecord


Route = tuple[RouteHop, ...]


# Search nodes are (boundary, server index): server -1 is "between servers" at that boundary,
# server i >= 0 is "inside server i, having run the blocks up to that boundary". Distances are
# (blocks on zero-throughput servers, nanoseconds, hops), compared in that order. Whole
# nanoseconds keep sums exact, so equally cheap chains tie exactly and the hop count decides.
_Node = tuple[int, int]
_Dist = tuple[int, int, int]


def _nanoseconds(seconds: float) -> int:
    return round(seconds * 1e9)


def cheapest_route(
    by_block: list[list[ServerRecord]],
    start: int,
    end: int,
    *,
    rtts: Mapping[str, float],
    default_rtt_s: float,
    relayed_penalty_s: float,
    throughputs: Mapping[str, float] | None = None,
) -> Route:
    """The cheapest hops through blocks [start, end), given each block's usable holders (every
    block has one): RTT and relay penalty per hop, seconds per block on each server."""
    costs = _Costs.of(by_block, rtts, default_rtt_s, relayed_penalty_s, throughputs or {})
    parent = _shortest_paths(costs, by_block, start, end)
    return _route_back(parent, costs.servers, start, end)


@dataclass(frozen=True)
class _Costs:
    """The servers holding some block, numbered, and what the search charges for them."""

    servers: list[ServerRecord]
    index: dict[str, int]  # peer_id -> number
    entry: list[int]  # entering a server: its RTT and relay penalty (ns)
    step: list[int]  # one block on it (ns; 0 on a stalled server, which `stalled` counts)
    stalled: list[int]  # 1 per block on a zero-throughput server

    @staticmethod
    def of(
        by_block: list[list[ServerRecord]],
        rtts: Mapping[str, float],
        default_rtt_s: float,
        relayed_penalty_s: float,
        throughputs: Mapping[str, float],
    ) -> _Costs:
        servers: list[ServerRecord] = []
        index: dict[str, int] = {}
        for holders in by_block:
            for record in holders:
                if record.peer_id not in index:
                    index[record.peer_id] = len(servers)
                    servers.append(record)
        speed = [throughputs.get(r.peer_id, r.throughput) for r in servers]
        return _Costs(
            servers=servers,
            index=index,
            entry=[
                _nanoseconds(
                    rtts.get(r.peer_id, default_rtt_s) + (relayed_penalty_s if r.relayed else 0)
                )
                for r in servers
            ],
            step=[
                0 if t <= 0 else _nanoseconds(1.0 / (t * r.num_blocks))
                for r, t in zip(servers, speed, strict=True)
            ],
            stalled=[1 if t <= 0 else 0 for t in speed],
        )


def _shortest_paths(
    costs: _Costs, by_block: list[list[ServerRecord]], start: int, end: int
) -> dict[_Node, _Node]:
    """Dijkstra from boundary `start` until boundary `end` is settled: each node's parent."""
    source: _Node = (start, -1)
    dist: dict[_Node, _Dist] = {source: (0, 0, 0)}
    parent: dict[_Node, _Node] = {}
    heap: list[tuple[_Dist, _Node]] = [((0, 0, 0), source)]

    def relax(node: _Node, d: _Dist, came_from: _Node) -> None:
        old = dist.get(node)
        if old is None or d < old:
            dist[node] = d
            parent[node] = came_from
            heapq.heappush(heap, (d, node))

    while heap:
        d, node = heapq.heappop(heap)
        if d > dist[node]:
            continue
        boundary, server = node
        if server == -1:
            if boundary == end:
                break
            for record in by_block[boundary - start]:  # enter a server holding the next block
                i = costs.index[record.peer_id]
                cost = costs.entry[i] + costs.step[i]
                relax((boundary + 1, i), (d[0] + costs.stalled[i], d[1] + cost, d[2] + 1), node)
        else:
            relax((boundary, -1), d, node)  # leave the server here
            if boundary < min(costs.servers[server].end, end):  # or run its next block
                step = (d[0] + costs.stalled[server], d[1] + costs.step[server], d[2])
                relax((boundary + 1, server), step, node)
    return parent


def _route_back(
    parent: dict[_Node, _Node], servers: list[ServerRecord], start: int, end: int
) -> Route:
    """The hops on the path the search found to boundary `end`, in order."""
    # Every block has a holder (plan_route checked), so the end boundary was reached.
    hops: list[RouteHop] = []
    source: _Node = (start, -1)
    node: _Node = (end, -1)
    hop_end = end
    while node != source:
        previous = parent[node]
        if node[1] >= 0 and previous[1] == -1:  # entered server node[1] at previous[0]
            record = servers[node[1]]
            hops.append(RouteHop(record.peer_id, previous[0], hop_end, record))
        elif node[1] == -1 and previous[1] >= 0:  # left a server at this boundary
            hop_end = node[0]
        node = previous
    hops.reverse()
    return tuple(hops)


def spread_route(
    by_block: list[list[ServerRecord]],
    start: int,
    end: int,
    rng: random.Random,
    throughputs: Mapping[str, float] | None = None,
) -> Route:
    """Hops chosen at random at each boundary, weighted by throughput, each run to the end of
    its server's span: training's many short calls spread over the servers."""
    throughputs = throughputs or {}
    hops: list[RouteHop] = []
    boundary = start
    while boundary < end:
        holders = by_block[boundary - start]
        weights = [throughputs.get(r.peer_id, r.throughput) for r in holders]
        if not math.fsum(weights) > 0:
            weights = [1.0] * len(holders)  # all stalled: any of them beats no route
        record = rng.choices(holders, weights=weights)[0]
        hop_end = min(record.end, end)
        hops.append(RouteHop(record.peer_id, boundary, hop_end, record))
        boundary = hop_end
    return tuple(hops)
