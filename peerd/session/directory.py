"""Signed server records in the DHT, for a real daemon: the discovery routing.discovery designs
and routing.simulate measures at 10,000 peers, over py-libp2p's Kademlia.

A server signs its record (routing.discovery.sign_record, with its libp2p key) every refresh
period and stores it at the REPLICAS DHT peers closest to its shard's key, at each of
`shard_levels` of the swarm's size as its view estimates it: a Kademlia look-up of the key
(`peerd.node.lookup.closest_peers`), then one RECORDS_PROTOCOL request per holder.

Every daemon is such a holder for the keys it is closest to: `RecordBoard` keeps a
routing.record_store.RecordShard per key, and believes a record only if its own peer signed it
(`open_record`: nobody publishes a record for another peer id, a span outside the model or an
impossible throughput), so that what it hands out was at least signed by the server it names.

A client (every daemon's SwarmView) reads its model's shard (one look-up, READ_HOLDERS of the
holders asked side by side), more shards while a block has no server in what it read, and
believes each record again itself (`believe`). What the records say is still only the servers'
word: SwarmView confirms the servers a route needs with a live `info` call before routing
through them (`choose_contacts` when the directory lists more than MAX_CONTACTS).

What the look-ups cost is counted (`DiscoveryStats`): Kademlia queries per look-up, bytes of
records fetched, `info` calls; and when the first route could be planned (peerd bench scale
compares these with the simulator's).

Not done here: locality cells and lanes (routing.discovery.cells_around) need network
coordinates, which daemons do not compute yet; a daemon publishes and reads records without.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import random
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID

import wire
from peerd.node.lookup import closest_peers
from peerd.node.p2p import Node
from peerd.node.streams import MessageStream, PeerGone
from peerd.session.hops import DIAL_FAULTS, PEER_FAULTS
from routing.discovery import (
    Believed,
    SignedRecord,
    believe,
    shard_count,
    shard_key,
    shard_levels,
    shard_of,
    sign_record,
)
from routing.record_store import RecordShard
from routing.records import ServerRecord

log = logging.getLogger(__name__)

RECORDS_PROTOCOL = TProtocol("/peerd/records/1.0.0")
# Holders a server stores its record at (per shard key), and holders a client asks at once.
REPLICAS = 3
READ_HOLDERS = 2
# Shards of the model a client reads at most (the first, then more while a block has no server).
MAX_SHARD_READS = 4
LOOKUP_TIMEOUT_S = 3.0
# Look-ups whose estimates of the DHT's size the median is taken over, and how many it needs.
SIZE_SAMPLES = 8
MIN_SIZE_SAMPLES = 3
# A shard key's holders found by a look-up are used again for this many refresh periods (a
# publish and a read of the same key, the next periods' publishes) unless a request to one of
# them fails: holders change only as peers join and leave, and every look-up costs a round of DHT
# requests on each node it asks (in a small swarm, a third of an idle daemon's work).
HOLDERS_FRESH_PERIODS = 2
REQUEST_TIMEOUT_S = 3.0
# What a refresh spends on the directory at most, look-ups and reads together.
READ_BUDGET_S = 4.0
# Shard keys one daemon holds records for: any peer may name any key, so it is bounded (the
# least recently used key goes); 256 records of <= 2 KB each per key.
MAX_KEYS = 64
# Record puts one peer may make here: PUT_BURST at once, then PUT_RATE_PER_S. An honest server
# stores its record at 3 shard levels per refresh period (a few puts a minute at the 60 s default,
# about 1.5 a second at test swarms' 2 s), so the bucket never holds one back; a peer flooding
# puts costs us at most that many record checks a second: a further put is refused before
# its record is checked.
PUT_RATE_PER_S = 4.0
PUT_BURST = 32
# Peers whose buckets are kept (peer ids are free: the one heard from least recently goes).
MAX_PUT_PEERS = 4096

ShardKey = tuple[str, str, int, int, int]  # swarm, model, num_blocks, shard, shards


class RecordBoard:
    """The records this daemon keeps as a DHT node, per shard key (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.shards: OrderedDict[ShardKey, RecordShard] = OrderedDict()
        self.kept = 0  # records accepted
        self.refused = 0  # records refused (forged, malformed, another shard's)
        self.throttled = 0  # puts refused unchecked: their peer was over PUT_RATE_PER_S
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> tokens, at

    @staticmethod
    def key_of(request: wire.RecordsRequest) -> ShardKey:
        if request.shard >= request.shards:
            raise ValueError(f"shard {request.shard} of {request.shards} does not exist")
        return (request.swarm, request.model, request.num_blocks, request.shard, request.shards)

    def put(self, request: wire.RecordsRequest) -> ServerRecord:
        """Keep the request's record; ValueError (ForgedRecord) saying why not."""
        assert request.record is not None
        key = self.key_of(request)
        shard = self.shards.get(key)
        if shard is None:
            shard = RecordShard(
                request.model, request.num_blocks, request.shard, request.shards, request.swarm
            )
        try:
            record = shard.offer(SignedRecord.from_bytes(request.record), self.clock())
        except ValueError:
            self.refused += 1
            raise
        self.kept += 1
        self.shards[key] = shard
        self.shards.move_to_end(key)
        while len(self.shards) > MAX_KEYS:
            self.shards.popitem(last=False)
        return record

    def may_put(self, peer: str) -> bool:
        """Whether `peer` may put a record now (its bucket had a token, which this takes)."""
        now = self.clock()
        tokens, at = self._buckets.pop(peer, (float(PUT_BURST), now))
        tokens = min(float(PUT_BURST), tokens + max(0.0, now - at) * PUT_RATE_PER_S)
        allowed = tokens >= 1
        self._buckets[peer] = (tokens - 1 if allowed else tokens, now)
        while len(self._buckets) > MAX_PUT_PEERS:
            self._buckets.popitem(last=False)
        if not allowed:
            self.throttled += 1
        return allowed

    def get(self, request: wire.RecordsRequest) -> tuple[bytes, ...]:
        shard = self.shards.get(self.key_of(request))
        if shard is None:
            return ()
        return tuple(signed.to_bytes() for signed in shard.records(self.clock()))

    async def handle(self, stream: Any, remote_peer: str | None = None) -> None:
        """One request per stream: a put is answered with an empty reply, a get with the
        records; a bad request gets Error(bad_request) saying why, and ends only this stream."""
        messages = MessageStream(stream, wire.DEFAULT_MAX_FRAME_SIZE, remote_peer)
        try:
            request = await messages.receive_as(wire.RecordsRequest, REQUEST_TIMEOUT_S)
            if request.record is not None and not self.may_put(messages.remote_peer):
                message = (
                    f"too many record puts from {messages.remote_peer}: at most "
                    f"{PUT_RATE_PER_S:g} a second after a burst of {PUT_BURST}; retry later"
                )
                await messages.send(wire.Error(code=wire.ErrorCode.BUSY, message=message))
                return
            try:
                if request.record is not None:
                    self.put(request)
                    reply = wire.RecordsReply()
                else:
                    reply = wire.RecordsReply(records=self.get(request))
            except ValueError as e:
                code = wire.ErrorCode.BAD_REQUEST
                await messages.send(wire.Error(code=code, message=f"record refused: {e}"))
                return
            await messages.send(reply)
        except wire.ProtocolError as e:
            with contextlib.suppress(PeerGone):
                await messages.send(wire.Error(code=wire.ErrorCode.BAD_REQUEST, message=str(e)))
        except PeerGone as e:
            log.debug("records stream from %s ended: %s", messages.remote_peer, e)
        finally:
            await messages.close()


@dataclass
class DiscoveryStats:
    """What finding servers through the directory cost, and when the first route could be
    planned (seconds after the view started; the `first_*` figures are the costs until then)."""

    started: float = field(default_factory=time.monotonic)
    lookups: int = 0
    lookup_messages: int = 0  # Kademlia queries our look-ups sent
    record_bytes: int = 0
    contacts: int = 0  # `info` calls
    first_route_s: float | None = None
    first: dict[str, int] = field(default_factory=dict)

    def route_found(self) -> None:
        if self.first_route_s is None:
            self.first_route_s = time.monotonic() - self.started
            self.first = {
                "lookups": self.lookups,
                "lookup_messages": self.lookup_messages,
                "record_bytes": self.record_bytes,
                "contacts": self.contacts,
            }


# The look-up a Kademlia query belongs to (trio tasks inherit the context of their parent).
_counting: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "peerd_lookup_queries", default=None
)


def count_lookup_queries(node: Node) -> None:
    """Count the Kademlia queries each of our look-ups sends: our look-up (peerd.node.lookup)
    asks one peer at a time through `_query_peer_for_closest`; wrapped once per node."""
    routing = node.dht.peer_routing
    query: Callable[..., Awaitable[list[ID]]] = routing._query_peer_for_closest
    if getattr(query, "_peerd_counted", False):
        return

    async def counted(peer: ID, target_key: bytes) -> list[ID]:
        if (box := _counting.get()) is not None:
            box[0] += 1
        return await query(peer, target_key)

    counted._peerd_counted = True  # type: ignore[attr-defined]
    routing._query_peer_for_closest = counted  # type: ignore[method-assign]


class Directory:
    """Publishes this daemon's record and reads its model's shards (module docstring)."""

    def __init__(
        self,
        node: Node,
        model: str,
        num_blocks: int,
        swarm_name: str = "",
        refresh_period: float = 0.0,
    ) -> None:
        self.node, self.model, self.num_blocks = node, model, num_blocks
        self.swarm_name = swarm_name
        self.holders_fresh_s = HOLDERS_FRESH_PERIODS * refresh_period  # 0: look up every time
        # (key, count, our DHT mode) -> (fresh until, holders)
        self._holders: dict[tuple[bytes, int, DHTMode], tuple[float, list[ID]]] = {}
        self.stats = DiscoveryStats()
        self.rng = random.Random()
        self.board: RecordBoard | None = None  # our own, when we hold records for others
        self.sizes: deque[float] = deque(maxlen=SIZE_SAMPLES)  # the DHT's, by our look-ups

    def estimate(self, servers_known: int) -> float:
        """The swarm's size to shard by: the servers we know, or the DHT's size as our last
        look-ups found it when that is bigger (a daemon that just joined a big swarm knows few
        servers, and its view holds a sample of the swarm, never all of it). One look-up's
        estimate can be several times off in a small swarm (it counts the few closest peers
        that answered), so it takes MIN_SIZE_SAMPLES of them."""
        if len(self.sizes) < MIN_SIZE_SAMPLES:
            return float(servers_known)
        return max(float(servers_known), statistics.median(self.sizes))

    def hold_records(self) -> RecordBoard:
        """Hold records for other peers as a DHT node: answer RECORDS_PROTOCOL from a board."""
        self.board = RecordBoard()
        self.node.host.set_stream_handler(RECORDS_PROTOCOL, self.board.handle)
        return self.board

    def _key(self, shard: int, shards: int) -> bytes:
        return shard_key(self.model, shard, shards, self.swarm_name)

    def _request(self, shard: int, shards: int, record: bytes | None) -> wire.RecordsRequest:
        return wire.RecordsRequest(
            swarm=self.swarm_name,
            model=self.model,
            num_blocks=self.num_blocks,
            shard=shard,
            shards=shards,
            record=record,
        )

    async def holders(self, key: bytes, count: int) -> list[ID]:
        """The `count` peers closest to `key` that Kademlia finds, ourselves included while we
        are a DHT server (a node behind NAT, a DHT client, is nobody's holder); those of a
        look-up at most HOLDERS_FRESH_PERIODS refresh periods old, unless one failed since."""
        now = trio.current_time()
        entry = (key, count, self.node.dht.mode)  # a DHT client is nobody's holder
        cached = self._holders.get(entry)
        if cached is not None and now < cached[0]:
            return list(cached[1])
        found = await self._look_up(key, count)
        if any(peer != self.node.peer_id for peer in found):  # none: try again next time
            if len(self._holders) >= MAX_KEYS:
                self._holders.clear()
            self._holders[entry] = (now + self.holders_fresh_s, found)
        return found

    def _failed(self, peer: ID) -> None:
        """A request to `peer` failed: look its keys' holders up afresh next time."""
        for key, (_, peers) in list(self._holders.items()):
            if peer in peers:
                del self._holders[key]

    async def _look_up(self, key: bytes, count: int) -> list[ID]:
        count_lookup_queries(self.node)
        box = [0]
        token = _counting.set(box)
        found: list[ID] = []
        try:
            with trio.move_on_after(LOOKUP_TIMEOUT_S):
                found, size = await closest_peers(self.node, key, count)
                self.sizes.append(size)
        except Exception as e:  # a DHT hiccup: no holders this time
            log.debug("look-up of %s failed: %s", key.hex()[:12], e)
        finally:
            _counting.reset(token)
            self.stats.lookups += 1
            self.stats.lookup_messages += box[0]
        ours = [self.node.peer_id] if self.node.dht.mode == DHTMode.SERVER else []
        peers = list(dict.fromkeys([*found, *ours]))
        return sort_peer_ids_by_distance(key, peers)[:count]

    async def _ask(self, peer: ID, request: wire.RecordsRequest) -> wire.RecordsReply | None:
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                raw = await self.node.open_stream(peer, RECORDS_PROTOCOL)
                stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
                try:
                    await stream.send(request)
                    reply = await stream.receive(REQUEST_TIMEOUT_S)
                finally:
                    await stream.close()
        except (*PEER_FAULTS, *DIAL_FAULTS) as e:
            log.debug("records request to %s failed: %s", peer, e)
            self._failed(peer)
            return None
        if isinstance(reply, wire.Error):
            log.info("peer %s refused a records request: %s", peer, reply.message)
        return reply if isinstance(reply, wire.RecordsReply) else None

    async def publish(self, record: ServerRecord, estimated_servers: int) -> int:
        """Store our signed record under our shard's key at each shard level; the number of
        holders that kept it."""
        signed = sign_record(record, self.node.host.get_private_key()).to_bytes()
        stored = 0

        async def store(shards: int) -> None:
            nonlocal stored
            shard = shard_of(record.peer_id, shards)
            request = self._request(shard, shards, signed)
            for peer in await self.holders(self._key(shard, shards), REPLICAS):
                if peer == self.node.peer_id:
                    stored += self._own_board(request) is not None
                elif await self._ask(peer, request) is not None:
                    stored += 1

        async with trio.open_nursery() as nursery:
            for shards in shard_levels(shard_count(self.estimate(estimated_servers))):
                nursery.start_soon(store, shards)
        return stored

    def _own_board(self, request: wire.RecordsRequest) -> tuple[bytes, ...] | None:
        """A request to ourselves, as a holder: None if we hold no board or it refused."""
        if self.board is None:
            return None
        try:
            if request.record is not None:
                self.board.put(request)
                return ()
            return self.board.get(request)
        except ValueError as e:
            log.warning("our own board refused a records request: %s", e)
            return None

    async def read_shard(self, shard: int, shards: int) -> list[SignedRecord]:
        """The records READ_HOLDERS of the shard key's holders keep, side by side, and those of
        its other holders too when what they hold leaves a block without a server (holders
        found by two look-ups may differ while routing tables fill)."""
        request = self._request(shard, shards, None)
        fetched: dict[bytes, SignedRecord] = {}

        async def read(peer: ID) -> None:
            if peer == self.node.peer_id:
                records = self._own_board(request) or ()
            elif (reply := await self._ask(peer, request)) is not None:
                records = reply.records
            else:
                return
            for raw in records:
                self.stats.record_bytes += len(raw)
                with contextlib.suppress(ValueError):
                    fetched.setdefault(raw, SignedRecord.from_bytes(raw))

        holders = await self.holders(self._key(shard, shards), REPLICAS)
        for group in (holders[:READ_HOLDERS], holders[READ_HOLDERS:]):
            async with trio.open_nursery() as nursery:
                for peer in group:
                    nursery.start_soon(read, peer)
            if not self._believe(list(fetched.values())).snapshot.uncovered_blocks():
                break
        return list(fetched.values())

    async def read(self, estimated_servers: int) -> Believed:
        """Our model's servers as the directory lists them: one shard, then others (and other
        shard levels) while a block has no server in what was read; forged records refused.
        Within READ_BUDGET_S, and no further once a read finds nothing at all (a directory
        nobody publishes in yet: provider keys find the servers), so a refresh waits on it
        seconds at most."""
        shards = shard_count(self.estimate(estimated_servers))
        fetched: list[SignedRecord] = []
        with trio.move_on_after(READ_BUDGET_S):
            reads = self._reads(shards)
            while reads:
                more = await self.read_shard(*reads.pop(0))
                fetched += more
                looked = self.sizes[-1] if self.sizes else 0.0  # our latest look-up's
                if not more and (bigger := shard_count(looked)) > 2 * shards:
                    # A look-up found the swarm far bigger than we knew (we just joined it;
                    # on a first read, the look-up of that key): nobody stores at our shard
                    # count; read at the look-up's instead.
                    shards, reads = bigger, self._reads(bigger)
                    continue
                if not more or not self._believe(fetched).snapshot.uncovered_blocks():
                    break
        return self._believe(fetched)

    def _reads(self, shards: int) -> list[tuple[int, int]]:
        """The shards to read, in order: MAX_SHARD_READS at most, of `shards`, then of its other
        levels."""
        order = self.rng.sample(range(shards), min(shards, MAX_SHARD_READS))
        reads = [(i, shards) for i in order]
        reads += [(self.rng.randrange(n), n) for n in shard_levels(shards) if n != shards]
        return reads[:MAX_SHARD_READS]

    def _believe(self, fetched: list[SignedRecord]) -> Believed:
        return believe(
            [(None, signed) for signed in fetched],
            model=self.model,
            num_blocks=self.num_blocks,
            now=time.time(),
            swarm_name=self.swarm_name,
        )
