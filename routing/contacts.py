"""Which servers a client contacts before its first token, and when their answers suffice.

A client has read records (routing.discovery) and estimated RTTs to their servers; it contacts
only `choose_contacts`: the servers of a few alternative routes, then those `servers_to_confirm`
names, never more than MAX_CONTACTS, instead of every server the DHT names. It plans once
`answers_suffice`, over the live records the servers answered (`confirmed_record`).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Collection, Mapping

from routing.bans import BanList
from routing.planner import NoRouteError, plan_route
from routing.records import SELECTION_STATES, ServerRecord, SwarmSnapshot

# Before its first token a client contacts at most this many servers (each an `info` call).
MAX_CONTACTS = 24
# ...the hops of the cheapest route and of up to this many more that avoid the servers chosen
# before: RTTs estimated from coordinates (15% off) rank a segment's best server only among
# its first few, and asking them all at once costs one round trip where asking more later costs
# one each (the simulator at 3,000 peers: 4 routes gave 1.078x the optimum, 8 gave 1.043).
ALTERNATIVE_ROUTES = 8


def choose_contacts(
    snapshot: SwarmSnapshot,
    *,
    rtts: Mapping[str, float] | None = None,
    bans: BanList | None = None,
    now: float | None = None,
    max_contacts: int = MAX_CONTACTS,
    alternatives: int = ALTERNATIVE_ROUTES,
    rng: random.Random | None = None,
) -> list[str]:
    """The servers a client contacts before its first route, cheapest route's first: the hops of
    the cheapest route over `snapshot`, then of the cheapest routes that avoid the servers
    already chosen, up to `max_contacts` (the live `info` calls confirm them and measure RTTs;
    the route is then planned over those that answered). NoRouteError if no route exists."""
    chosen: list[str] = []
    blocked: set[str] = set()
    for attempt in range(max(1, alternatives)):
        try:
            route = plan_route(
                snapshot, rtts=rtts, bans=bans or (), now=now, blocked_servers=blocked, rng=rng
            )
        except NoRouteError:
            if attempt == 0:
                raise
            break
        for hop in route:
            if hop.peer_id not in chosen:
                chosen.append(hop.peer_id)
            blocked.add(hop.peer_id)
        if len(chosen) >= max_contacts:
            break
    return chosen[:max_contacts]


def servers_to_confirm(
    snapshot: SwarmSnapshot,
    live: Mapping[str, tuple[float, ServerRecord]],
    asked: Collection[str],
    estimates: Mapping[str, float],
) -> list[str]:
    """The servers not yet asked that the cheapest route would use, planned over those that
    answered (`live`: measured RTT and live record) and those of `snapshot` not yet asked (RTTs
    estimated): a client asks them and plans again, so that an estimate too pessimistic about
    a server it did not contact costs it one more round trip, not a worse route. Empty when the
    route needs no one more (or none exists)."""
    unasked = tuple(r for r in snapshot.records if r.peer_id not in asked)
    records = unasked + tuple(record for _, record in live.values())
    rtts = {**estimates, **{p: rtt for p, (rtt, _) in live.items()}}
    try:
        route = plan_route(SwarmSnapshot(snapshot.model, snapshot.num_blocks, records), rtts=rtts)
    except NoRouteError:
        return []
    return list(dict.fromkeys(h.peer_id for h in route if h.peer_id not in live))


def answers_suffice(
    awaited: SwarmSnapshot,
    live: Mapping[str, tuple[float, ServerRecord]],
    estimates: Mapping[str, float] | None = None,
) -> bool:
    """Whether a client may plan its first route on the `live` answers (measured RTT and live
    record) without waiting for the `awaited` servers (RTTs `estimates`, else the median
    measured): the answers serve every block, and the cheapest route over them and the awaited
    wants none of the awaited. So a slow or gone server no route wants holds nothing back."""
    records = tuple(record for _, record in live.values())
    served = SwarmSnapshot(awaited.model, awaited.num_blocks, records)
    if not live or served.uncovered_blocks(states=SELECTION_STATES):
        return False
    if estimates is None:
        typical = statistics.median(rtt for rtt, _ in live.values())
        estimates = {record.peer_id: typical for record in awaited.records}
    return not servers_to_confirm(awaited, live, (), estimates)


def confirmed_record(published: ServerRecord, live: ServerRecord) -> ServerRecord | None:
    """What a route may use of a server whose DHT record was `published` and whose live `info`
    answer (over a connection authenticated as that peer) is `live`: the live record, whatever
    it says now (a server that moved is planned with the span it serves, never the one it
    published), or None when the answer is not that peer's record of this model."""
    if live.peer_id != published.peer_id or live.model != published.model:
        return None
    return live
