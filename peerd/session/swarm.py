"""What this daemon knows of the swarm: announcing its own blocks in the DHT, finding who serves
the others, and confirming each candidate with a live `info` call before routing through it.

The DHT only says who *might* serve a block (py-libp2p keeps provider records long after a peer
dies); a server is in our view only while it answers `info`."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Collection, Iterable

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

import wire
from peerd.node.p2p import INFO_PROTOCOL, JOINED_PROTOCOL, LEAVING_PROTOCOL, Node
from peerd.node.streams import Idle, MessageStream
from peerd.session.dht_keys import block_key, model_key, models_key
from peerd.session.directory import Directory
from peerd.session.hops import DIAL_FAULTS, PEER_FAULTS
from peerd.session.local import LocalServer
from routing.bans import BanList
from routing.contacts import MAX_CONTACTS, answers_suffice, choose_contacts
from routing.planner import NoRouteError, Route, plan_route
from routing.records import SELECTION_STATES, ServerRecord, SwarmSnapshot, info_to_record
from routing.rtt import RttTracker
from routing.speeds import StepSpeeds

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 3.0
# How long a refresh may take on a loaded machine (a provider look-up, then the info calls, each
# up to INFO_TIMEOUT_S, twice when blocks are looked up one by one): added to a record's expiry.
REFRESH_SLACK_S = 4 * INFO_TIMEOUT_S
# A server we lost because it could not be reached (not because it left) is remembered this long,
# so a route that finds no server can say which one is out of reach and why.
LOST_SERVER_MEMORY_S = 600.0
MAX_PROVIDERS = 64
# A DHT node keeps at most 20 providers per key: from this many servers in our view the model key
# may not list them all, so a server the directory keeps no record of provides its blocks' keys
# too (find_candidates looks up blocks nothing else covered). Each provide is a look-up plus
# ADD_PROVIDERs: block keys were most of an idle daemon's CPU (py-spy; docs/swarm.md).
BLOCK_KEYS_FROM_SERVERS = 10
BLOCK_LOOKUP_CONCURRENCY = 4
# Joining and leaving (heard_join, heard_leave): a peer that says it joined is asked for its
# record at most once in this many seconds, by at most this many look-ups at once; what we know
# of who joined and left is kept for so many peers; telling the peers we know takes at most
# TELL_TIMEOUT_S, and at most MAX_TOLD of them are told.
JOIN_MIN_INTERVAL_S = 5.0
JOIN_LOOKUPS = 8
MAX_PRESENCE_MEMORY = 4096
TELL_TIMEOUT_S = 5.0
MAX_TOLD = 256


def _forget_oldest(times: dict[str, float]) -> None:
    """Keep a peer -> time map under MAX_PRESENCE_MEMORY entries: drop the oldest half."""
    if len(times) >= MAX_PRESENCE_MEMORY:
        for peer_id in sorted(times, key=times.__getitem__)[: len(times) // 2]:
            del times[peer_id]


class SwarmView:
    """This daemon's live picture of the servers of one model."""

    def __init__(
        self,
        node: Node,
        model: str,
        num_blocks: int,
        *,
        refresh_period: float,
        own_record: Callable[[], ServerRecord | None] = lambda: None,
        swarm_name: str = "",
    ) -> None:
        self.node = node
        self.swarm_name = swarm_name
        self.model = model
        self.num_blocks = num_blocks
        self.refresh_period = refresh_period
        self.own_record = own_record
        self.records: dict[str, ServerRecord] = {}
        # The last record each server answered with, and why the servers we could not open a
        # connection to at the last try were out of reach (peerd.session.route.explain_unreachable).
        self.last_seen: dict[str, ServerRecord] = {}
        self.unreachable: dict[str, str] = {}
        # Servers whose last `info` call failed (no connection, or no answer in time). On a
        # loaded machine one look-up can miss a live server: its record stays until it expires.
        self.missed: set[str] = set()
        # This daemon's own block server, reached directly when a route uses it.
        self.local_server: LocalServer | None = None
        self.rtts = RttTracker()
        self.speeds = StepSpeeds()  # how fast servers ran our steps (record_step)
        self.bans = BanList()
        # Fraction of steps this daemon's sessions re-run on a second server (peerd.session.verify).
        self.verify_fraction = 0.0
        self.pipeline_prompts: bool | None = None  # in chunks: steps.pipeline_chunks (None: auto)
        # peer -> (the standing it said it grants us when it last opened a session, when)
        self.standing_seen: dict[str, tuple[float, float]] = {}
        self._refresh_lock = trio.Lock()
        # Servers that told us they leave (SIGTERM), and when: no refresh brings them back until
        # they say they joined again or 2 refresh periods pass. When each peer last said it
        # joined (rate limit), and the join look-ups running now.
        self.left: dict[str, float] = {}
        self._join_heard: dict[str, float] = {}
        self._join_lookups = trio.CapacityLimiter(JOIN_LOOKUPS)
        self._joined_meanwhile: dict[str, ServerRecord] = {}  # while a refresh runs
        # Called with every record of our swarm a peer answers, of any model (how a daemon
        # learns the swarm's other models: peerd.daemon.models).
        self.on_record: Callable[[ServerRecord], None] = lambda record: None
        # Signed records in the DHT (peerd.session.directory): published by announce, read
        # first by find_candidates; provider keys find the servers it does not list.
        self.directory = Directory(node, model, num_blocks, swarm_name, refresh_period)
        self._listed: dict[str, ServerRecord] = {}  # what the directory listed at the last read
        # Set once the view is worth routing on: after the first refresh, or sooner (_first_view).
        self.ready = trio.Event()

    # --- announcing ---------------------------------------------------------------------------

    async def announce(self, blocks: Iterable[int]) -> None:
        """Provide the model keys and store our record in the directory, every refresh period;
        our blocks' keys too once the model key may not list every server, unless the directory
        kept our record (readers find us there; see BLOCK_KEYS_FROM_SERVERS)."""
        name = self.swarm_name

        async def publish() -> None:
            own, stored = self.own_record(), 0
            if own is not None:
                stored = await self.directory.publish(own, estimated_servers=len(self.records))
            if len(self.records) >= BLOCK_KEYS_FROM_SERVERS and not stored:
                await self.node.provide(block_key(self.model, b, name) for b in blocks)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            await self.node.provide([model_key(self.model, name), models_key(name)])

    # --- discovering --------------------------------------------------------------------------

    async def _providers(self, key: str, serving_it: bool, into: list[PeerInfo]) -> None:
        # Cached provider records (our own, or ones from earlier look-ups) would answer alone:
        # forget them to ask the network. Our own record stays when we provide the key.
        if not serving_it:
            self.node.forget_cached_providers(key)
        with trio.move_on_after(INFO_TIMEOUT_S):
            try:
                into += await self.node.dht.find_providers(key, count=MAX_PROVIDERS)
            except Exception as e:
                log.debug("find_providers(%s) failed: %s", key[:12], e)

    async def find_candidates(self, blocks: Iterable[int] = ()) -> dict[str, PeerInfo]:
        """Peers the DHT lists for the model, and for each of `blocks` (not yet confirmed)."""
        own, found, listed = self.own_record(), dict[str, PeerInfo](), list[PeerInfo]()
        keys, serving = [model_key(self.model, self.swarm_name)], own is not None
        if not blocks:  # servers of every model (their records name the swarm's models), found
            async with trio.open_nursery() as nursery:  # beside the directory's read
                nursery.start_soon(self._providers, models_key(self.swarm_name), serving, listed)
                if await self._from_directory(found):  # it lists a server for every block
                    keys.clear()
        for key in keys:
            await self._providers(key, serving, listed)
        for info in listed:
            found.setdefault(info.peer_id.to_string(), info)
        # Look-ups of the same peers at once overload py-libp2p's stream negotiation; a few
        # at a time is as fast on a small swarm and kinder on a big one.
        limiter = trio.CapacityLimiter(BLOCK_LOOKUP_CONCURRENCY)

        async def look_up(block: int) -> None:
            async with limiter:
                key, providers = block_key(self.model, block, self.swarm_name), list[PeerInfo]()
                await self._providers(key, own is not None and own.covers(block), providers)
                for info in providers:
                    found.setdefault(info.peer_id.to_string(), info)

        async with trio.open_nursery() as nursery:
            for block in blocks:
                nursery.start_soon(look_up, block)
        known = list(self.records)  # keep asking the servers we know even if the DHT forgot
        if not blocks:
            # ...and the DHT nodes we know of: behind NAT a provider look-up can time out
            # (other NATed nodes are unreachable for it) while those nodes, asked through a
            # relay, are the servers we look for.
            known += [p.to_string() for p in self.node.dht.routing_table.get_peer_ids()]
        for peer_id in known[:MAX_PROVIDERS]:
            if peer_id not in found:
                peer = ID.from_base58(peer_id)
                found[peer_id] = PeerInfo(peer, self.node.host.get_peerstore().addrs(peer))
        return found

    async def _from_directory(self, found: dict[str, PeerInfo]) -> bool:
        """Add the servers the directory lists (all of them up to MAX_CONTACTS; beyond, those
        of the cheapest few routes, `choose_contacts`) to `found`; whether they cover every
        block."""
        believed = await self.directory.read(estimated_servers=len(self.records))
        snapshot = believed.snapshot
        wanted = [r.peer_id for r in snapshot.records]
        if len(wanted) > MAX_CONTACTS:
            try:
                wanted = choose_contacts(snapshot, rtts=self.rtts, bans=self.bans, now=time.time())
            except NoRouteError:
                wanted = wanted[:MAX_CONTACTS]
        for peer_id in wanted:
            peer = ID.from_base58(peer_id)
            self.node.remember(peer, snapshot.by_peer[peer_id].addrs)
            found.setdefault(peer_id, PeerInfo(peer, []))
        self._listed = {p: snapshot.by_peer[p] for p in wanted}
        return bool(snapshot.records) and not snapshot.uncovered_blocks()

    async def fetch_record(self, peer: PeerInfo) -> ServerRecord | None:
        """Ask a peer for its live record; None if it does not answer well in time."""
        peer_id = peer.peer_id.to_string()
        started = 0.0
        reached = False
        self.directory.stats.contacts += 1
        try:
            with trio.fail_after(INFO_TIMEOUT_S):
                if peer.addrs:
                    self.node.host.get_peerstore().add_addrs(peer.peer_id, peer.addrs, 3600)
                raw = await self.node.open_stream(peer.peer_id, INFO_PROTOCOL)
                reached, started = True, time.perf_counter()  # the round trip, not the dial
                stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
                try:
                    await stream.send(wire.InfoRequest())
                    reply = await stream.receive(INFO_TIMEOUT_S)
                finally:
                    await stream.close()
        except (*PEER_FAULTS, *DIAL_FAULTS) as e:  # anything else is our bug: raised
            log.debug("info from %s failed: %s", peer_id, e)
            if isinstance(e, (trio.TooSlowError, Idle)):
                # Slow, maybe only loaded: its record stays until it expires.
                self.missed.add(peer_id)
            else:  # refused, reset or closed: nobody serves there now, it leaves the view
                self.missed.discard(peer_id)
            if not reached and peer_id in self.last_seen:
                tried = ", ".join(map(str, self.node.host.get_peerstore().addrs(peer.peer_id)))
                self.unreachable[peer_id] = (
                    str(e) or f"no connection within {INFO_TIMEOUT_S:g} s to {tried}"
                )
            return None
        self.unreachable.pop(peer_id, None)
        self.missed.discard(peer_id)
        if not isinstance(reply, wire.InfoResponse):
            return None
        try:
            record = info_to_record(reply.record)
        except ValueError as e:
            log.info("peer %s sent a bad record: %s", peer_id, e)
            return None
        if record.peer_id != peer_id:
            return None
        if record.swarm != self.swarm_name:  # met through mDNS or a shared DHT node
            log.debug("peer %s serves swarm %r, not ours", peer_id, record.swarm)
            return None
        self.on_record(record)
        if record.model != self.model:
            return None
        self.rtts.record(peer_id, time.perf_counter() - started)
        # Expiry on our own clock (peers' clocks may be off): a server that stops answering
        # leaves our view after two refresh periods even if no request to it ever fails. The
        # slack covers a refresh's own duration: on a loaded machine one takes several
        # INFO_TIMEOUT_S, and a record it could not confirm must outlive it, or a live swarm
        # leaves the view whole (seen in CI with a 2 s refresh period).
        now = time.time()
        expires_at = now + 2 * self.refresh_period + REFRESH_SLACK_S
        return dataclasses.replace(record, updated_at=now, expires_at=expires_at)

    async def refresh(self) -> None:
        """Rebuild the view: every candidate the DHT names is asked for its live record. Blocks
        that the servers found through the model key leave uncovered are looked up one by one.
        A known server that was only slow to answer this look-up keeps its record until the
        record expires (two refresh periods and REFRESH_SLACK_S after it last answered); one
        that refused or reset it leaves now, as does one a request fails on (report_failure). A
        first view is in once the listed servers' answers suffice (_first_view), whoever of
        them is still awaited: other peers (routing table, models key) join at the end."""
        async with self._refresh_lock:
            fresh: dict[str, ServerRecord] = {}
            candidates = await self.find_candidates()
            await self._confirm(candidates, fresh, () if self.records else self._listed)
            snapshot = SwarmSnapshot.from_records(self.model, self.num_blocks, fresh.values())
            if missing := snapshot.uncovered_blocks(states=SELECTION_STATES):
                await self._confirm(await self.find_candidates(missing), fresh)
            now = time.time()
            for peer_id, record in self.records.items():
                if peer_id not in fresh and peer_id in self.missed and not record.is_expired(now):
                    fresh[peer_id] = record
            self._settle_presence(fresh)
            gone = set(self.records) - set(fresh)
            if gone:
                log.info("servers left the swarm view: %s", ", ".join(sorted(gone)))
            self.records = fresh
            self._remember_seen(fresh)
            if not self.snapshot().uncovered_blocks(states=SELECTION_STATES):
                self.directory.stats.route_found()
            for peer_id in gone:
                self.rtts.forget(peer_id)
                self.speeds.forget(peer_id)
            self.ready.set()

    async def _confirm(
        self,
        candidates: dict[str, PeerInfo],
        into: dict[str, ServerRecord],
        first: Collection[str] = (),
    ) -> None:
        """Every candidate's live record into `into`; once `first` have answered, _first_view."""
        own_id = self.node.peer_id.to_string()
        awaited = {p for p in first if p in candidates and p != own_id and p not in into}

        async def confirm(peer_id: str, info: PeerInfo) -> None:
            record = await self.fetch_record(info)
            if record is not None and not self.has_left(peer_id):
                into[peer_id] = record
            if peer_id in awaited:
                awaited.discard(peer_id)
                self._first_view(into, awaited)

        async with trio.open_nursery() as nursery:
            for peer_id, info in candidates.items():
                if peer_id != own_id and peer_id not in into:
                    nursery.start_soon(confirm, peer_id, info)
        if (own := self.own_record()) is not None:
            into[own_id] = own

    def _first_view(self, found: dict[str, ServerRecord], awaited: Collection[str]) -> None:
        """While the view is empty, route on `found` (and our own record) once it is enough
        without the listed servers still `awaited` (routing.contacts.answers_suffice)."""
        view = dict(found)
        if (own := self.own_record()) is not None:
            view[own.peer_id] = own
        live = {p: (self.rtts.get(p, 0.0), record) for p, record in view.items()}
        listed = SwarmSnapshot(self.model, self.num_blocks, tuple(self._listed[p] for p in awaited))
        if not self.records and answers_suffice(listed, live):
            self.records = view
            self._remember_seen(view)
            self.directory.stats.route_found()
            self.ready.set()

    # --- joining and leaving ------------------------------------------------------------------

    def hear_joins_and_leaves(self) -> None:
        """Take the joined/leaving streams peers open to us (peerd.node.p2p.Node.on_told)."""
        self.node.on_told(JOINED_PROTOCOL, self._heard_join_from)
        self.node.on_told(LEAVING_PROTOCOL, self._heard_leave_from)

    async def _heard_join_from(self, peer: ID) -> None:
        await self.heard_join(peer.to_string())

    async def _heard_leave_from(self, peer: ID) -> None:
        self.heard_leave(peer.to_string())

    async def tell_joined(self) -> int:
        """Tell the servers in our view and our other neighbours that we are online (each then
        asks us for our record); return how many were told."""
        peers = self.node.neighbours(self.records, MAX_TOLD)
        return await self.node.tell(peers, JOINED_PROTOCOL, TELL_TIMEOUT_S)

    async def tell_leaving(self) -> int:
        """Tell them that we are leaving: they drop us from their views at once."""
        peers = self.node.neighbours(self.records, MAX_TOLD)
        return await self.node.tell(peers, LEAVING_PROTOCOL, TELL_TIMEOUT_S)

    def has_left(self, peer_id: str) -> bool:
        """The server told us it leaves, less than 2 refresh periods ago."""
        at = self.left.get(peer_id)
        return at is not None and time.time() - at < 2 * self.refresh_period

    async def heard_join(self, peer_id: str) -> bool:
        """A peer told us it joined. Its word is not taken: we ask it for its record, as a
        refresh does (at most once every JOIN_MIN_INTERVAL_S per peer, JOIN_LOOKUPS at once,
        else the next refresh will), and add it to the view if it serves our model. Return
        whether it was added."""
        now = time.time()
        if now - self._join_heard.get(peer_id, -math.inf) < JOIN_MIN_INTERVAL_S:
            return False
        _forget_oldest(self._join_heard)
        self._join_heard[peer_id] = now
        try:
            self._join_lookups.acquire_nowait()
        except trio.WouldBlock:
            return False
        try:
            record = await self.fetch_record(PeerInfo(ID.from_base58(peer_id), []))
        finally:
            self._join_lookups.release()
        if record is None or peer_id == self.node.peer_id.to_string():
            return False
        self.left.pop(peer_id, None)
        self.records[peer_id] = record
        self._remember_seen({peer_id: record})
        if self._refresh_lock.locked():  # it may have looked before the server was up
            self._joined_meanwhile[peer_id] = record
        log.info("server %s joined (blocks %d:%d)", peer_id, record.start, record.end)
        return True

    def heard_leave(self, peer_id: str) -> None:
        """The server `peer_id` (the authenticated peer of the stream: nobody can make another
        peer leave) is going: out of the view now, and kept out for 2 refresh periods, however
        the DHT and its draining record still list it."""
        _forget_oldest(self.left)
        self.left[peer_id] = time.time()
        self._joined_meanwhile.pop(peer_id, None)
        if self.records.pop(peer_id, None) is not None:
            log.info("server %s left the swarm", peer_id)
        self.missed.discard(peer_id)
        self.rtts.forget(peer_id)
        self.speeds.forget(peer_id)

    def _settle_presence(self, fresh: dict[str, ServerRecord]) -> None:
        """End of a refresh (`fresh`: what it found): a server that said it joined while the
        refresh ran stays in the view, and one that said it leaves stays out of it. Of two
        records of a server, the later fetched one stands: a refresh that asked a server while
        it was still loading must not put it back as joining after it said it is online (it
        stayed so in a view for a refresh period, in CI)."""
        for peer_id, record in self._joined_meanwhile.items():
            found = fresh.get(peer_id)
            if found is None or found.updated_at < record.updated_at:
                fresh[peer_id] = record
        self._joined_meanwhile.clear()
        for peer_id in [p for p in fresh if self.has_left(p)]:
            del fresh[peer_id]

    def _remember_seen(self, fresh: dict[str, ServerRecord]) -> None:
        self.last_seen.update(fresh)
        now = time.time()
        for peer_id, record in list(self.last_seen.items()):
            if now - record.updated_at > LOST_SERVER_MEMORY_S:
                del self.last_seen[peer_id]
                self.unreachable.pop(peer_id, None)

    def report_failure(self, peer_id: str) -> None:
        """A server failed us: drop it from the view at once and ban it with backoff (the next
        refresh re-adds it if it answers, and routing uses it again once the ban ends)."""
        self.records.pop(peer_id, None)
        self.rtts.record_failure(peer_id)
        self.bans.record_failure(peer_id, time.time())

    def report_lie(self, peer_id: str) -> None:
        """A server returned wrong results (peerd.session.verify caught it): out of the view and
        banned
        for a long time, whatever it answers later."""
        self.records.pop(peer_id, None)
        self.bans.ban_liar(peer_id, time.time())

    def link(self, peer_id: str) -> str:
        """How we reach a server now: "direct", "relayed" (through a circuit relay), "none"
        (no connection open), or "local" (our own server)."""
        if peer_id == self.node.peer_id.to_string():
            return "local"
        return self.node.connection_kind(ID.from_base58(peer_id))

    def report_success(self, peer_id: str) -> None:
        self.bans.record_success(peer_id)

    def record_step(self, peer_id: str, blocks: int, tokens: int, seconds: float) -> None:
        """A server answered a step of `tokens` tokens through `blocks` of its blocks `seconds`
        after it was sent; routing believes announced throughputs only so far (routing.speeds)."""
        rtt_s = self.rtts.get(peer_id, 0.0)
        self.speeds.record(peer_id, blocks=blocks, tokens=tokens, seconds=seconds, rtt_s=rtt_s)

    def plan(self, start: int = 0, end: int | None = None, **kwargs: object) -> Route:
        """The cheapest route over [start, end) in the current view (NoRouteError if none)."""
        return plan_route(
            self.snapshot(),
            start,
            end,
            rtts=self.rtts,
            bans=self.bans,
            now=time.time(),
            measured=self.speeds,
            **kwargs,  # type: ignore[arg-type]
        )

    def snapshot(self) -> SwarmSnapshot:
        now = time.time()
        records = list(self.records.values())
        return SwarmSnapshot.from_records(self.model, self.num_blocks, records, now=now)

    async def run(self, rng: random.Random | None = None) -> None:
        """Refresh forever, every refresh period with a little jitter so peers spread out."""
        rng = rng or random.Random()
        while True:
            try:
                await self.refresh()
            except Exception as e:
                log.warning("swarm refresh failed: %s", e)
            await trio.sleep(self.refresh_period * rng.uniform(0.8, 1.0))

    async def wait_for(self, predicate: Callable[[SwarmSnapshot], bool], timeout: float) -> bool:
        """Refresh until `predicate(snapshot)` holds or `timeout` passes."""
        with trio.move_on_after(timeout):
            while not predicate(self.snapshot()):
                await self.refresh()
                if not predicate(self.snapshot()):
                    await trio.sleep(min(0.5, self.refresh_period))
            return True
        return False
