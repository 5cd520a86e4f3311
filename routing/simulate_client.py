"""A client of the simulated swarm (routing.simulate) finding its first route with
routing.discovery, as a daemon would, and what it cost: time, messages, bytes, and the route's
cost against the offline optimum.

Join through an initial peer, whose first answer is a `Hint`: the swarm's size as it estimates
it and how its sample of the swarm spreads over locality cells. Then, side by side, read one
shard of the whole swarm and, in each of the 2x2 locality cells around us (`cells_around`), the
lane that holds about `lane_records` of the cell's fastest servers (`lane_tier`, the cell's size
from the hint). An initial peer that knows too little to size lanes by (it just joined) gives
way to a self look-up for the size, then the lanes after the shard, sized by its census. Read
more shards of the whole swarm while a block has no server in what we read. Our look-ups start
from the peers we know (at first, the initial peer), not from a routing table we never filled.
Plan `choose_contacts` with RTTs estimated from the coordinates in the records, call `info` on
them (measured RTT; a departed server does not answer; a record its server no longer backs is
dropped, `confirmed_record`), then ask the servers not yet asked that the route over the answers
and the estimates still wants (`servers_to_confirm`), and route over the confirmed records with
the measured RTTs. If the answers leave a block unserved, read the rest of those shards and ask
again.

Cost is what routing.planner charges (RTT plus compute per hop, credible throughputs of the
whole swarm) with the true RTTs, for the client's route and for the route planned over every
live server with every true RTT (the offline optimum): the same objective measured the same way.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from routing.chains import Route
from routing.contacts import (
    MAX_CONTACTS,
    answers_suffice,
    choose_contacts,
    confirmed_record,
    servers_to_confirm,
)
from routing.discovery import (
    Cell,
    SignedRecord,
    authentic,
    believe,
    cell_of,
    cells_around,
    estimated_rtt,
    lane_tier,
    shard_count,
    shard_key,
    shard_levels,
)
from routing.netsim import DIAL_RTTS, STREAM_RTTS, Lookup, kad_id
from routing.planner import DEFAULT_RTT_S, NoRouteError, plan_route, route_cost
from routing.records import ServerRecord, SwarmSnapshot
from routing.simulate import MODEL, REPLICAS, STORE_BYTES, Swarm
from routing.speeds import credible_throughputs
from wire import ServerState

INFO_BYTES = (40, 320)  # an info request and its reply
# Round trips an `info` to a server the client has no connection to takes: the dial, the stream
# and the request (routing.netsim); the waits below are counted in them.
FIRST_CONTACT_RTTS = 1 + STREAM_RTTS + DIAL_RTTS
# How long a client waits for an `info` answer at most: the daemon's INFO_TIMEOUT_S.
INFO_DEADLINE_S = 3.0
# How long a client that has a route already waits for servers that might make it better: one
# worth it is near (a round trip well under 150 ms), so a later answer is not waited for.
BETTER_DEADLINE_S = 0.15 * FIRST_CONTACT_RTTS
PATIENCE_S = 0.05
# `info` calls a client makes at first; then, REPLAN_ROUNDS times at most, the servers the route
# over the answers still wants (`servers_to_confirm`), MAX_CONTACTS in all (CONTACT_ROUNDS times
# as many while the answers leave a block unserved).
FIRST_CONTACTS = MAX_CONTACTS
REPLAN_ROUNDS = 3
CONTACT_ROUNDS = 3
# Holders of a shard asked at first (the daemon's, peerd.session.directory).
READ_HOLDERS = 2
# Holders of a lane asked (a lane is a part of a cell; what its holder withholds, the shard and
# the other lanes make up for, at worse routes, never wrong ones).
LANE_HOLDERS = 1
# A lane's holder sends its fastest LANE_LIMIT x lane_records servers at most (a lane sized
# from a few servers of a sample can hold up to RECORDS_PER_SHARD).
LANE_LIMIT = 2
# Shards of the whole swarm a client reads more when what it read leaves a block unserved.
MORE_SHARDS = 3

# peer -> (seconds until its answer was in, the round trip measured, its live record)
Answers = dict[str, tuple[float, float, ServerRecord]]


@dataclass
class ClientRun:
    """What one client's way to its first route cost."""

    first_route_s: float = 0.0
    messages: int = 0
    bytes: int = 0
    lookups: int = 0
    lookup_messages: int = 0
    lookup_hops: int = 0
    contacts: int = 0
    cost_ratio: float = math.inf


def first_route(swarm: Swarm, name: str, access_s: float | None = None) -> ClientRun | None:
    """One client's way to its first route; None if it found none. With `access_s`, the client
    has that access delay (routing.netsim's `place`) instead of a drawn place in the network."""
    if access_s is None:
        peer = swarm.net.add(name, member=False)
    else:
        peer = swarm.net.place(name, access_s, member=False)
    try:
        return _Client(swarm, peer.kid).route()
    finally:
        swarm.net.remove(peer.kid)


class _Client:
    def __init__(self, swarm: Swarm, kid: int) -> None:
        self.swarm, self.kid, self.out = swarm, kid, ClientRun()
        self.spare: list[bytes] = []  # shard keys of the whole swarm not read yet
        self.asked: set[str] = set()
        self.confirmed: Answers = {}

    def route(self) -> ClientRun | None:
        fetched = self._fetch()
        route = self._contact(*self._believe(fetched))
        if route is None and self.spare:  # what answered leaves a block unserved: read more
            fetched += _flat(self._read(self.spare, fetched))
            snapshot, estimates = self._believe(fetched)
            route = self._confirm_more(snapshot, estimates, None)
        self.out.contacts = len(self.asked)
        if route is None:
            return None
        self.out.cost_ratio = self._cost_ratio(route)
        return self.out

    def _believe(self, fetched: list[SignedRecord]) -> tuple[SwarmSnapshot, dict[str, float]]:
        swarm = self.swarm
        believed = believe(
            [(None, s) for s in fetched], model=MODEL, num_blocks=swarm.num_blocks, now=swarm.now
        )
        own = swarm.net.coords(self.kid)
        estimates = {p: estimated_rtt(own, c) for p, c in believed.coords.items()}
        return believed.snapshot, estimates

    def _read(
        self,
        keys: list[bytes],
        have: list[SignedRecord] | None = None,
        lanes: list[bytes] | None = None,
    ) -> list[list[SignedRecord]]:
        """Read the shards under `keys` and the `lanes` side by side (the slowest read counts),
        each as the daemon reads one (peerd.session.directory): a Kademlia look-up of the key's
        closest peers, then READ_HOLDERS of its REPLICAS holders asked side by side, and for a
        shard of the whole swarm the others too when what those hold, with what we `have`,
        leaves a block unserved (a lane is a part of a cell by design). The records read, key
        by key, lanes last."""
        read: list[list[SignedRecord]] = []
        slowest = 0.0
        out, net = self.out, self.swarm.net
        start = net.known(self.kid)  # look-ups side by side start from what we know now
        for name in [*keys, *(lanes or ())]:
            key, whole = kad_id(name), name in keys
            fetched: list[SignedRecord] = []
            found = net.look_up(self.kid, key, start=start)
            self._count(found)
            holders = found.closest[: REPLICAS if whole else LANE_HOLDERS]
            seconds = found.seconds
            for group in (holders[:READ_HOLDERS], holders[READ_HOLDERS:]):
                seconds += max(
                    (self._ask_holder(h, key, fetched, not whole) for h in group), default=0.0
                )
                if not whole or not self._uncovered([*(have or ()), *fetched]):
                    break
            slowest = max(slowest, seconds)
            read.append(fetched)
        out.first_route_s += slowest
        return read

    def _count(self, found: Lookup) -> None:
        out = self.out
        out.lookups += 1
        out.lookup_messages += found.messages
        out.lookup_hops += found.hops
        out.messages += found.messages
        out.bytes += found.bytes

    def _lanes(self, cell_servers: Callable[[Cell], float]) -> list[bytes]:
        """The lane keys to read: in each cell around us, the tier holding about lane_records
        of its fastest servers (the cell holding about `cell_servers(cell)`)."""
        records = self.swarm.lane_records
        cells = cells_around(self.swarm.net.coords(self.kid))
        tiers = [lane_tier(cell_servers(cell), records) for cell in cells]
        return [shard_key(MODEL, 0, 1, cell=c, tier=t) for c, t in zip(cells, tiers, strict=True)]

    def _ask_holder(
        self, holder: int, key: int, into: list[SignedRecord], lane: bool = False
    ) -> float:
        """The records `holder` keeps under `key` (of a lane, the LANE_LIMIT x lane_records
        fastest), added to `into`; the seconds it took."""
        swarm, out = self.swarm, self.out
        shard = swarm.stores.get(holder, {}).get(key)
        if shard is None:
            records = []
        elif lane:
            records = shard.fastest(swarm.now, LANE_LIMIT * swarm.lane_records)
        else:
            records = shard.records(swarm.now)
        size = sum(len(r) for r in records) + 16
        out.messages += 2
        out.bytes += STORE_BYTES + size
        into += records
        return swarm.net.exchange(self.kid, holder, STORE_BYTES, size, "read")

    def _uncovered(self, fetched: list[SignedRecord]) -> bool:
        swarm, records = self.swarm, (authentic(s)[0] for s in fetched)
        served = SwarmSnapshot.from_records(MODEL, swarm.num_blocks, records, now=swarm.now)
        return bool(served.uncovered_blocks())

    def _fetch(self) -> list[SignedRecord]:
        """Join; one shard of the whole swarm and the lanes of the cells around us, side by side
        when the initial peer's hint sizes the lanes, else the lanes after the shard, sized by
        its census (and the swarm's size from a self look-up first); then more shards of the
        whole swarm while a block has no server in what we read."""
        swarm, net = self.swarm, self.swarm.net
        hint, self.out.first_route_s = swarm.welcome(self.kid)
        estimate = hint.estimate
        if not hint.usable:  # the initial peer knows little of the swarm yet: look ourselves
            found = net.look_up(self.kid, self.kid, start=net.known(self.kid))
            self._count(found)
            estimate, self.out.first_route_s = (
                net.estimate_size(found.closest, self.kid),
                self.out.first_route_s + found.seconds,
            )
        shards = shard_count(estimate)
        order = swarm.rng.sample(range(shards), min(shards, 1 + MORE_SHARDS))
        shard = [shard_key(MODEL, order[0], shards)]
        if hint.usable:
            first, *lanes = self._read(shard, lanes=self._lanes(hint.cell_servers))
        else:
            first = self._read(shard)[0]
            census = Counter(cell_of(c) for s in first if (c := authentic(s)[1]) is not None)
            lanes = self._read([], lanes=self._lanes(lambda cell: max(1, census[cell]) * shards))
        fetched = _flat([first, *lanes])
        # More of the whole swarm: other shards, then shards of the other levels (other holders).
        more = [(i, shards) for i in order[1:]]
        more += [(swarm.rng.randrange(n), n) for n in shard_levels(shards) if n != shards]
        self.spare = [shard_key(MODEL, index, count) for index, count in more[:MORE_SHARDS]]
        while self.spare and self._uncovered(fetched):
            fetched += _flat(self._read([self.spare.pop(0)], fetched))
        return fetched

    def _contact(self, snapshot: SwarmSnapshot, estimates: dict[str, float]) -> Route | None:
        """`info` to the servers `choose_contacts` names; plan as soon as the answers in are
        enough (`_settle`), then `_confirm_more`."""
        try:
            contacts = choose_contacts(
                snapshot,
                rtts=estimates,
                now=self.swarm.now,
                rng=self.swarm.rng,
                max_contacts=FIRST_CONTACTS,
            )
        except NoRouteError:
            return None
        answers = self._ask(snapshot, contacts)
        ready = self._settle(snapshot, estimates, contacts, answers)
        self.out.first_route_s += ready
        self.confirmed = _by(answers, ready)
        return self._confirm_more(snapshot, estimates, self._live_route(self.confirmed))

    def _settle(
        self,
        snapshot: SwarmSnapshot,
        estimates: dict[str, float],
        contacts: list[str],
        answers: Answers,
    ) -> float:
        """When to plan: the first moment the route over the answers in and the servers still
        awaited (with estimated RTTs) wants none of those awaited. A server is awaited until
        twice what a first contact at its estimated round trip takes and PATIENCE_S (or
        INFO_DEADLINE_S), so that one gone does not hold the first route back until the
        deadline."""
        patience = {
            p: min(
                INFO_DEADLINE_S,
                2 * FIRST_CONTACT_RTTS * estimates.get(p, DEFAULT_RTT_S) + PATIENCE_S,
            )
            for p in contacts
        }
        moments = {a[0] for a in answers.values()} | set(patience.values())
        for moment in sorted(t for t in moments if t <= INFO_DEADLINE_S):
            confirmed = _by(answers, moment)
            awaited = tuple(
                snapshot.by_peer[p] for p in contacts if p not in confirmed and patience[p] > moment
            )
            pending = SwarmSnapshot(MODEL, self.swarm.num_blocks, awaited)
            if not awaited or answers_suffice(pending, _measured(confirmed), estimates):
                return moment
        return INFO_DEADLINE_S

    def _confirm_more(
        self, snapshot: SwarmSnapshot, estimates: dict[str, float], route: Route | None
    ) -> Route | None:
        """Ask the servers not asked yet that the route over the answers and the estimates
        wants, and plan again, until it wants no one more (see the module's limits)."""
        for round_ in range(REPLAN_ROUNDS + CONTACT_ROUNDS):
            if route is not None and round_ >= REPLAN_ROUNDS:
                break
            limit = MAX_CONTACTS * (1 if route is not None else CONTACT_ROUNDS)
            more = servers_to_confirm(snapshot, _measured(self.confirmed), self.asked, estimates)
            more = more[: limit - len(self.asked)]
            if not more:
                break
            answers = self._ask(snapshot, more)
            deadline = INFO_DEADLINE_S if route is None else BETTER_DEADLINE_S
            took = max(answers.get(p, (math.inf,))[0] for p in more)
            self.out.first_route_s += min(deadline, took)
            self.confirmed |= _by(answers, deadline)
            route = self._live_route(self.confirmed)
        return route

    def _live_route(self, confirmed: Answers) -> Route | None:
        """The cheapest route over the servers that answered, with the RTTs measured; None if
        they leave a block unserved."""
        live = SwarmSnapshot(MODEL, self.swarm.num_blocks, tuple(a[2] for a in confirmed.values()))
        try:
            return plan_route(live, rtts={p: a[1] for p, a in confirmed.items()})
        except NoRouteError:
            return None

    def _ask(self, snapshot: SwarmSnapshot, contacts: list[str]) -> Answers:
        """`info` to every contact at once: per answering server, when it answered, the round
        trip measured and its live record (if it backs the one it published)."""
        answers: Answers = {}
        swarm, out = self.swarm, self.out
        self.asked.update(contacts)
        for peer_id in contacts:
            server = swarm.servers.get(kad_id(peer_id))
            out.messages += 1
            out.bytes += INFO_BYTES[0]
            if server is None or server.record is None:  # gone: no answer
                continue
            took = swarm.net.exchange(self.kid, server.kid, *INFO_BYTES, "info")
            out.messages += 1
            out.bytes += INFO_BYTES[1]
            live = confirmed_record(snapshot.by_peer[peer_id], server.record)
            if live is not None:
                rtt = swarm.net.measured_rtt(self.kid, server.kid, *INFO_BYTES)
                answers[peer_id] = (took, rtt, live)
        return answers

    def _cost_ratio(self, route: Route) -> float:
        """The route's cost against the offline optimum, both charged with true RTTs."""
        swarm = self.swarm
        truth = swarm.truth()
        rtts = {r.peer_id: swarm.net.rtt(self.kid, kad_id(r.peer_id)) for r in truth.records}
        return cost_vs_optimum(route, truth, rtts)


def cost_vs_optimum(route: Route, truth: SwarmSnapshot, rtts: dict[str, float]) -> float:
    """What `route` costs against the offline optimum, the cheapest route over every online
    server of `truth` with the true RTTs `rtts` (from the client to each server): both charged
    as routing.planner charges them, with the credible throughputs of the whole swarm."""
    credible = credible_throughputs(truth.records)
    best = plan_route(_pareto(truth, rtts, credible), rtts=rtts)
    mine = route_cost(route, rtts=rtts, throughputs=credible)
    return mine / route_cost(best, rtts=rtts, throughputs=credible)


def _flat(read: list[list[SignedRecord]]) -> list[SignedRecord]:
    return [signed for records in read for signed in records]


def _measured(answers: Answers) -> dict[str, tuple[float, ServerRecord]]:
    """Per answer, the round trip measured and the live record."""
    return {p: (rtt, record) for p, (_, rtt, record) in answers.items()}


def _by(answers: Answers, seconds: float) -> Answers:
    """The answers in within `seconds`."""
    return {p: a for p, a in answers.items() if a[0] <= seconds}


def _pareto(
    truth: SwarmSnapshot, rtts: dict[str, float], credible: dict[str, float]
) -> SwarmSnapshot:
    """`truth` less the servers no optimal route needs: of servers of one span, one is never
    better than another with a lower RTT and a higher credible throughput (so planning stays
    fast at 10,000 servers)."""
    by_span: dict[tuple[int, int], list[ServerRecord]] = {}
    for record in truth.records:
        if record.state is ServerState.ONLINE:
            by_span.setdefault(record.span, []).append(record)
    kept: list[ServerRecord] = []
    for records in by_span.values():
        best = -math.inf
        for record in sorted(records, key=lambda r: rtts[r.peer_id]):
            if credible[record.peer_id] > best:
                best = credible[record.peer_id]
                kept.append(record)
    return SwarmSnapshot(truth.model, truth.num_blocks, tuple(kept))
