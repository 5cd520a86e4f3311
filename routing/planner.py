"""Route planning: which chain of (peer, span) hops carries hidden states through blocks a..b.

Pure over a `SwarmSnapshot` plus what the caller measured (RTTs) and learned (bans).

Inference (one long session per hop, latency-bound) takes the cheapest chain. A hop that runs
blocks [p, q) on server s costs

    rtt(s) + (q - p) * seconds_per_block(s) + (relayed_penalty_s if s is relayed else 0)

where rtt(s) is the smoothed RTT, or `default_rtt_s` for a peer never measured, and
seconds_per_block(s) = 1 / (throughput(s) * blocks in s's span), throughput being the decode-step
tokens/s of s's whole span (see routing.records). A hop may use any sub-range of a server's span,
so a fast server can take over from a slow one mid-span when that pays for the extra round trip.
The search is Dijkstra over block boundaries 0..L, with a node per (server, boundary) inside a
span so that leaving a server early is an ordinary edge. Among equally cheap chains it takes the
one with fewer hops; blocks on servers reporting zero throughput are avoided before anything else.

Training (forward/backward, many short independent calls) spreads load instead: at each boundary
it picks one of the servers holding the next block at random, weighted by throughput, and runs
it to the end of that server's span.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from routing.bans import BanList
from routing.records import (
    ROUTABLE_STATES,
    ServerRecord,
    SwarmSnapshot,
    contiguous_ranges,
    format_blocks,
)

Mode = Literal["inference", "training"]

# RTT assumed for a peer never pinged: a typical same-continent round trip, so an unmeasured
# peer is neither preferred over measured nearby ones nor shunned.
DEFAULT_RTT_S = 0.05
# Why a server outside the caller's allowed_servers is skipped (NoRouteError reasons).
NOT_ALLOWED = "not allowed"
# Extra cost of a server reached through a circuit relay: at least one more network leg, and
# relays cap bandwidth, so a direct server with the same span wins unless it is far slower.
DEFAULT_RELAYED_PENALTY_S = 0.1


@dataclass(frozen=True)
class RouteHop:
    """Run blocks [start, end) on `peer_id`; `record` is what the planner knew of it."""

    peer_id: str
    start: int
    end: int
    record: ServerRecord


Route = tuple[RouteHop, ...]


class NoRouteError(LookupError):
    """Some blocks have no usable server; the message says which and what to do.

    missing: half-open block ranges that no usable server holds.
    skipped: peer_id -> why, for the servers that hold some missing block but were not usable.
    absent_allowed: peers of the caller's allowed_servers that are not in the swarm at all.
    """

    def __init__(
        self,
        model: str,
        missing: Sequence[tuple[int, int]],
        skipped: Mapping[str, str],
        *,
        absent_allowed: Sequence[str] = (),
    ) -> None:
        self.model = model
        self.missing = tuple(missing)
        self.skipped = dict(skipped)
        self.absent_allowed = tuple(absent_allowed)
        super().__init__(self._message())

    @property
    def due_to_allowed_servers(self) -> bool:
        """Whether allowed_servers alone leave the blocks uncovered: some server outside it holds
        each of them, so waiting will not help but allowing one will."""
        return bool(self.skipped) and set(self.skipped.values()) == {NOT_ALLOWED}

    def _message(self) -> str:
        blocks = " and ".join(format_blocks(a, b) for a, b in self.missing)
        if self.due_to_allowed_servers:
            absent = (
                f"; {', '.join(self.absent_allowed)} "
                f"{'is' if len(self.absent_allowed) == 1 else 'are'} not in the swarm"
                if self.absent_allowed
                else ""
            )
            return (
                f"allowed_servers leave {blocks} of {self.model} uncovered: no allowed server "
                f"holds them, only {', '.join(sorted(self.skipped))}{absent}. Add a server that "
                "holds them to allowed_servers, or drop allowed_servers"
            )
        commands = " and ".join(f"`peerd start --blocks {a}:{b}`" for a, b in self.missing)
        one = "one" if len(self.missing) == 1 else "them"
        if not self.skipped:
            return f"no peer serves {blocks} of {self.model}: start {one} with {commands}"
        reasons = Counter(self.skipped.values())
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
        peers = "1 peer holds" if len(self.skipped) == 1 else f"{len(self.skipped)} peers hold"
        if any(reason.startswith("without adapter") for reason in reasons):
            commands = " and ".join(
                f"`peerd start --blocks {a}:{b} --adapters DIR`" for a, b in self.missing
            )
        return (
            f"no usable peer serves {blocks} of {self.model} ({peers} them but "
            f"{'is' if len(self.skipped) == 1 else 'are'} skipped: {why}): try again shortly, "
            f"or start {one} with {commands}"
        )


def hop_cost(
    record: ServerRecord,
    start: int,
    end: int,
    *,
    rtt_s: float,
    relayed_penalty_s: float = DEFAULT_RELAYED_PENALTY_S,
) -> float:
    """Seconds the planner charges for running blocks [start, end) on `record`'s server."""
    penalty = relayed_penalty_s if record.relayed else 0.0
    return rtt_s + (end - start) * record.seconds_per_block + penalty


def route_cost(
    route: Route,
    *,
    rtts: Mapping[str, float],
    default_rtt_s: float = DEFAULT_RTT_S,
    relayed_penalty_s: float = DEFAULT_RELAYED_PENALTY_S,
) -> float:
    """Sum of `hop_cost` over a route: the planner's estimate of one decode step, in seconds."""
    return sum(
        hop_cost(
            hop.record,
            hop.start,
            hop.end,
            rtt_s=rtts.get(hop.peer_id, default_rtt_s),
            relayed_penalty_s=relayed_penalty_s,
        )
        for hop in route
    )


def route_hops(route: Sequence[RouteHop]) -> tuple[str, ...]:
    """Each hop as 'peerA[0:10)', as the local API's messages list a route."""
    return tuple(f"{hop.peer_id}[{hop.start}:{hop.end})" for hop in route)


def format_route(route: Route) -> str:
    """A route as one log line: 'peerA[0:10) -> peerB[10:30)'."""
    return " -> ".join(route_hops(route)) or "(empty)"


def plan_route(
    snapshot: SwarmSnapshot,
    start: int = 0,
    end: int | None = None,
    *,
    rtts: Mapping[str, float] | None = None,
    bans: BanList | Collection[str] = (),
    now: float | None = None,
    relayed_penalty_s: float = DEFAULT_RELAYED_PENALTY_S,
    min_free_cache_tokens: int = 0,
    session_length: int = 0,
    allowed_servers: Collection[str] | None = None,
    blocked_servers: Collection[str] = (),
    mode: Mode = "inference",
    rng: random.Random | None = None,
    default_rtt_s: float = DEFAULT_RTT_S,
    adapter: str | None = None,
) -> Route:
    """Hops that together run exactly blocks [start, end) (end defaults to the last block).

    Only online servers are used, and none that is banned (a `BanList` is asked at `now`; a
    plain collection bans its peers outright), in `blocked_servers`, outside `allowed_servers`
    when that is given, or whose record expired by `now`. In inference mode a server also needs
    `min_free_cache_tokens` of free cache and must open sessions of `session_length` tokens (when
    its record announces a max_session_length). With `adapter`, only servers whose record lists
    that adapter are used. `rng` drives training mode's random choice.

    Raises NoRouteError when some block has no usable server, ValueError on bad arguments.
    """
    end = snapshot.num_blocks if end is None else end
    if not 0 <= start <= end <= snapshot.num_blocks:
        raise ValueError(
            f"cannot route blocks [{start}, {end}) of {snapshot.model}, "
            f"which has blocks 0-{snapshot.num_blocks - 1}"
        )
    if mode not in ("inference", "training"):
        raise ValueError(f"mode must be 'inference' or 'training', got {mode!r}")
    if isinstance(bans, BanList) and now is None:
        raise ValueError("plan_route needs `now` to ask a BanList who is banned")
    if start == end:
        return ()

    usable: list[ServerRecord] = []
    skipped: dict[str, str] = {}
    for record in sorted(snapshot.records, key=lambda r: r.peer_id):
        if record.end <= start or record.start >= end:
            continue
        reason = _skip_reason(
            record,
            bans=bans,
            now=now,
            allowed=allowed_servers,
            blocked=blocked_servers,
            min_free_cache_tokens=min_free_cache_tokens if mode == "inference" else 0,
            adapter=adapter,
            session_length=session_length if mode == "inference" else 0,
        )
        if reason is None:
            usable.append(record)
        else:
            skipped[record.peer_id] = reason

    by_block: list[list[ServerRecord]] = [[] for _ in range(end - start)]
    for record in usable:
        for block in range(max(record.start, start), min(record.end, end)):
            by_block[block - start].append(record)
    missing = contiguous_ranges(start + i for i, servers in enumerate(by_block) if not servers)
    if missing:

        def holds_missing(peer_id: str) -> bool:
            r = snapshot.by_peer[peer_id]
            return any(r.start < b and a < r.end for a, b in missing)

        reasons = {peer: why for peer, why in skipped.items() if holds_missing(peer)}
        absent = sorted(set(allowed_servers or ()) - set(snapshot.by_peer))
        raise NoRouteError(snapshot.model, missing, reasons, absent_allowed=absent)

    if mode == "training":
        return _spread_route(by_block, start, end, rng or random.Random())
    return _cheapest_route(
        by_block,
        start,
        end,
        rtts=rtts or {},
        default_rtt_s=default_rtt_s,
        relayed_penalty_s=relayed_penalty_s,
    )


def replan_from(
    snapshot: SwarmSnapshot,
    route: Route,
    failed_peer: str,
    *,
    rtts: Mapping[str, float] | None = None,
    bans: BanList | Collection[str] = (),
    now: float | None = None,
    relayed_penalty_s: float = DEFAULT_RELAYED_PENALTY_S,
    min_free_cache_tokens: int = 0,
    allowed_servers: Collection[str] | None = None,
    blocked_servers: Collection[str] = (),
    mode: Mode = "inference",
    rng: random.Random | None = None,
    default_rtt_s: float = DEFAULT_RTT_S,
    adapter: str | None = None,
) -> Route:
    """`route` with every hop on `failed_peer` replaced by hops over the same blocks.

    The other hops stay as they are (they hold session caches worth keeping); each failed hop
    [a, b) becomes whatever `plan_route` finds for [a, b) without `failed_peer`, possibly
    several hops. Raises NoRouteError if no other server can take some of those blocks.
    """
    if not any(hop.peer_id == failed_peer for hop in route):
        raise ValueError(f"peer {failed_peer!r} is not on the route {format_route(route)}")
    blocked = {*blocked_servers, failed_peer}
    new_route: list[RouteHop] = []
    for hop in route:
        if hop.peer_id != failed_peer:
            new_route.append(hop)
            continue
        new_route.extend(
            plan_route(
                snapshot,
                hop.start,
                hop.end,
                rtts=rtts,
                bans=bans,
                now=now,
                relayed_penalty_s=relayed_penalty_s,
                min_free_cache_tokens=min_free_cache_tokens,
                allowed_servers=allowed_servers,
                blocked_servers=blocked,
                mode=mode,
                rng=rng,
                default_rtt_s=default_rtt_s,
                adapter=adapter,
            )
        )
    return tuple(new_route)


def _skip_reason(
    record: ServerRecord,
    *,
    bans: BanList | Collection[str],
    now: float | None,
    allowed: Collection[str] | None,
    blocked: Collection[str],
    min_free_cache_tokens: int,
    adapter: str | None = None,
    session_length: int = 0,
) -> str | None:
    """Why a route must not use `record`'s server, in words for NoRouteError; None if usable."""
    if record.state not in ROUTABLE_STATES:
        return record.state.value
    if adapter is not None and adapter not in record.adapters:
        return f"without adapter {adapter}"
    if now is not None and record.is_expired(now):
        return "expired"
    if record.peer_id in blocked:
        return "blocked"
    if allowed is not None and record.peer_id not in allowed:
        return NOT_ALLOWED
    if isinstance(bans, BanList):
        assert now is not None  # plan_route checked
        if bans.is_banned(record.peer_id, now):
            return "banned after failures"
    elif record.peer_id in bans:
        return "banned after failures"
    if record.free_cache_tokens < min_free_cache_tokens:
        return "out of cache"
    if 0 < record.max_session_length < session_length:
        return "sessions too short"
    return None


# Search nodes are (boundary, server index): server -1 is "between servers" at that boundary,
# server i >= 0 is "inside server i, having run the blocks up to that boundary". Distances are
# (blocks on zero-throughput servers, nanoseconds, hops), compared in that order. Whole
# nanoseconds keep sums exact, so equally cheap chains tie exactly and the hop count decides.
_Node = tuple[int, int]
_Dist = tuple[int, int, int]


def _nanoseconds(seconds: float) -> int:
    return round(seconds * 1e9)


def _cheapest_route(
    by_block: list[list[ServerRecord]],
    start: int,
    end: int,
    *,
    rtts: Mapping[str, float],
    default_rtt_s: float,
    relayed_penalty_s: float,
) -> Route:
    servers: list[ServerRecord] = []
    index: dict[str, int] = {}
    for holders in by_block:
        for record in holders:
            if record.peer_id not in index:
                index[record.peer_id] = len(servers)
                servers.append(record)
    entry_cost = [
        _nanoseconds(rtts.get(r.peer_id, default_rtt_s) + (relayed_penalty_s if r.relayed else 0))
        for r in servers
    ]
    stalled = [1 if r.throughput <= 0 else 0 for r in servers]
    step_cost = [0 if r.throughput <= 0 else _nanoseconds(r.seconds_per_block) for r in servers]

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
            for record in by_block[boundary - start]:
                i = index[record.peer_id]
                relax(
                    (boundary + 1, i),
                    (d[0] + stalled[i], d[1] + entry_cost[i] + step_cost[i], d[2] + 1),
                    node,
                )
        else:
            relax((boundary, -1), d, node)
            if boundary < min(servers[server].end, end):
                relax(
                    (boundary + 1, server),
                    (d[0] + stalled[server], d[1] + step_cost[server], d[2]),
                    node,
                )

    # Every block has a holder (plan_route checked), so the end boundary was reached.
    hops: list[RouteHop] = []
    node = (end, -1)
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


def _spread_route(
    by_block: list[list[ServerRecord]], start: int, end: int, rng: random.Random
) -> Route:
    hops: list[RouteHop] = []
    boundary = start
    while boundary < end:
        holders = by_block[boundary - start]
        weights = [r.throughput for r in holders]
        if not math.fsum(weights) > 0:
            weights = [1.0] * len(holders)  # all stalled: any of them beats no route
        record = rng.choices(holders, weights=weights)[0]
        hop_end = min(record.end, end)
        hops.append(RouteHop(record.peer_id, boundary, hop_end, record))
        boundary = hop_end
    return tuple(hops)
