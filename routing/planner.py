"""Route planning: which chain of (peer, span) hops carries hidden states through blocks a..b.

Pure over a `SwarmSnapshot` plus what the caller measured (RTTs) and learned (bans).

Inference (one long session per hop, latency-bound) takes the cheapest chain. A hop that runs
blocks [p, q) on server s costs

    rtt(s) + (q - p) * seconds_per_block(s) + (relayed_penalty_s if s is relayed else 0)

where rtt(s) is the smoothed RTT, or `default_rtt_s` for a peer never measured, and
seconds_per_block(s) = 1 / (throughput(s) * blocks in s's span), throughput being the decode-step
tokens/s of s's whole span (see routing.records). A hop may use any sub-range of a server's span,
so a fast server can take over from a slow one mid-span when that pays for the extra round trip.
The search (routing.chains) is Dijkstra over block boundaries 0..L, with a node per (server,
boundary) inside a span so that leaving a server early is an ordinary edge. Among equally cheap
chains it takes the one with fewer hops; blocks on servers reporting zero throughput are avoided
before anything else.

Training (forward/backward, many short independent calls) spreads load instead: at each boundary
it picks one of the servers holding the next block at random, weighted by throughput, and runs
it to the end of that server's span.

Throughput is self-reported, so both modes plan with the credible throughput of routing.speeds:
the announced figure bounded by what the caller measured of the server's steps (`measured`) or,
before any measurement, by a multiple of the swarm's median speed per block.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal

from routing.bans import BanList
from routing.chains import Route, RouteHop, cheapest_route, spread_route
from routing.records import (
    ROUTABLE_STATES,
    ServerRecord,
    SwarmSnapshot,
    contiguous_ranges,
    format_blocks,
)
from routing.speeds import credible_throughputs

Mode = Literal["inference", "training"]

# RTT assumed for a peer never pinged: a typical same-continent round trip, so an unmeasured
# peer is neither preferred over measured nearby ones nor shunned.
DEFAULT_RTT_S = 0.05
# Why a server outside the caller's allowed_servers is skipped (NoRouteError reasons).
NOT_ALLOWED = "not allowed"
# Extra cost of a server reached through a circuit relay: at least one more network leg, and
# relays cap bandwidth, so a direct server with the same span wins unless it is far slower.
DEFAULT_RELAYED_PENALTY_S = 0.1


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
    throughput: float | None = None,
) -> float:
    """Seconds the planner charges for running blocks [start, end) on `record`'s server, whose
    throughput is taken as `throughput` (the credible one, routing.speeds) when given."""
    penalty = relayed_penalty_s if record.relayed else 0.0
    speed = record.throughput if throughput is None else throughput
    per_block = math.inf if speed <= 0 else 1.0 / (speed * record.num_blocks)
    return rtt_s + (end - start) * per_block + penalty


def route_cost(
    route: Route,
    *,
    rtts: Mapping[str, float],
    default_rtt_s: float = DEFAULT_RTT_S,
    relayed_penalty_s: float = DEFAULT_RELAYED_PENALTY_S,
    throughputs: Mapping[str, float] | None = None,
) -> float:
    """Sum of `hop_cost` over a route: the planner's estimate of one decode step, in seconds
    (with each server's throughput from `throughputs` where it has one)."""
    throughputs = throughputs or {}
    return sum(
        hop_cost(
            hop.record,
            hop.start,
            hop.end,
            rtt_s=rtts.get(hop.peer_id, default_rtt_s),
            relayed_penalty_s=relayed_penalty_s,
            throughput=throughputs.get(hop.peer_id),
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
    measured: Mapping[str, float] | None = None,
) -> Route:
    """Hops that together run exactly blocks [start, end) (end defaults to the last block).

    Only online servers are used, and none that is banned (a `BanList` is asked at `now`; a
    plain collection bans its peers outright), in `blocked_servers`, outside `allowed_servers`
    when that is given, or whose record expired by `now`. In inference mode a server also needs
    `min_free_cache_tokens` of free cache and must open sessions of `session_length` tokens (when
    its record announces a max_session_length). With `adapter`, only servers whose record lists
    that adapter are used. `rng` drives training mode's random choice. Throughputs are believed
    only as far as routing.speeds allows, with `measured` (a `StepSpeeds`) as the caller timed.

    Raises NoRouteError when some block has no usable server, ValueError on bad arguments.
    """
    end = snapshot.num_blocks if end is None else end
    _check_route_request(snapshot, start, end, mode, bans, now)
    if start == end:
        return ()
    inference = mode == "inference"
    reason = functools.partial(
        _skip_reason,
        bans=bans,
        now=now,
        allowed=allowed_servers,
        blocked=blocked_servers,
        min_free_cache_tokens=min_free_cache_tokens if inference else 0,
        adapter=adapter,
        session_length=session_length if inference else 0,
    )
    by_block, skipped = _holders_by_block(snapshot, start, end, reason)
    _check_covered(snapshot, start, by_block, skipped, allowed_servers)
    throughputs = credible_throughputs(snapshot.records, measured)
    if mode == "training":
        return spread_route(by_block, start, end, rng or random.Random(), throughputs)
    return cheapest_route(
        by_block,
        start,
        end,
        rtts=rtts or {},
        default_rtt_s=default_rtt_s,
        relayed_penalty_s=relayed_penalty_s,
        throughputs=throughputs,
    )


def _check_route_request(
    snapshot: SwarmSnapshot,
    start: int,
    end: int,
    mode: Mode,
    bans: BanList | Collection[str],
    now: float | None,
) -> None:
    if not 0 <= start <= end <= snapshot.num_blocks:
        raise ValueError(
            f"cannot route blocks [{start}, {end}) of {snapshot.model}, "
            f"which has blocks 0-{snapshot.num_blocks - 1}"
        )
    if mode not in ("inference", "training"):
        raise ValueError(f"mode must be 'inference' or 'training', got {mode!r}")
    if isinstance(bans, BanList) and now is None:
        raise ValueError("plan_route needs `now` to ask a BanList who is banned")


def _holders_by_block(
    snapshot: SwarmSnapshot,
    start: int,
    end: int,
    skip_reason: Callable[[ServerRecord], str | None],
) -> tuple[list[list[ServerRecord]], dict[str, str]]:
    """Per block of [start, end), the usable servers holding it (in peer_id order), and why
    each other server holding some of these blocks was skipped."""
    by_block: list[list[ServerRecord]] = [[] for _ in range(end - start)]
    skipped: dict[str, str] = {}
    for record in sorted(snapshot.records, key=lambda r: r.peer_id):
        if record.end <= start or record.start >= end:
            continue
        reason = skip_reason(record)
        if reason is not None:
            skipped[record.peer_id] = reason
            continue
        for block in range(max(record.start, start), min(record.end, end)):
            by_block[block - start].append(record)
    return by_block, skipped


def _check_covered(
    snapshot: SwarmSnapshot,
    start: int,
    by_block: list[list[ServerRecord]],
    skipped: Mapping[str, str],
    allowed_servers: Collection[str] | None,
) -> None:
    """NoRouteError naming the blocks no usable server holds, and why their holders were not."""
    missing = contiguous_ranges(start + i for i, servers in enumerate(by_block) if not servers)
    if not missing:
        return

    def holds_missing(peer_id: str) -> bool:
        r = snapshot.by_peer[peer_id]
        return any(r.start < b and a < r.end for a, b in missing)

    reasons = {peer: why for peer, why in skipped.items() if holds_missing(peer)}
    absent = sorted(set(allowed_servers or ()) - set(snapshot.by_peer))
    raise NoRouteError(snapshot.model, missing, reasons, absent_allowed=absent)


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
    measured: Mapping[str, float] | None = None,
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
                measured=measured,
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
