"""A simulated swarm of volunteer servers, running the project's real routing
code (block selection, the planner, bans, signed records, routing.discovery and
routing.record_store) over routing.netsim's network. routing.simulate_run drives it.

Servers: GPU memory drawn from volunteers' cards, as many blocks of an 80-block 70B-class model
as fit, a device speed drawn lognormally. A joining server looks up its own id (Kademlia
bootstrap, and the swarm's size from the ids it finds), reads one shard of the swarm (a uniform
sample of 1/shards of the servers) and chooses its span with `choose_blocks`, its own throughput
divided by the shard count so that it weighs against the sample as against the whole swarm. It
re-checks with `better_span` every recheck period over the same shard, reading only what changed
(`RecordShard.changes_since`); it stores its signed record at the REPLICAS closest DHT peers of
its shard key at each of `shard_levels` every publish period (looking them up again every
RELOOKUP_EVERY publishes, or when one left), and takes LOAD_S to load weights after a join or a
move (JOINING meanwhile: routes skip it).

It also stores it in its locality cell's lanes (`lane_tiers`) as far as its tier, its
`seconds_per_block` ranked within its sample (`tier_of`), goes. Clients: routing.simulate_client.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, field, replace

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from routing.block_selection import better_span, blocks_that_fit, choose_blocks
from routing.discovery import (
    LANE_RECORDS,
    Cell,
    Coords,
    SignedRecord,
    authentic,
    cell_of,
    lane_tiers,
    seconds_per_block,
    shard_count,
    shard_key,
    shard_levels,
    shard_of,
    sign_record,
    tier_of,
)
from routing.netsim import Lookup, Network, kad_id
from routing.record_store import RecordShard
from routing.records import ServerRecord, SwarmSnapshot
from wire import ServerState

MODEL = "sim-70b"
NUM_BLOCKS = 80
GIB = 2**30
BLOCK_BYTES = int(1.7 * GIB)
CACHE_BYTES = int(0.3 * GIB)
GPU_MEMORY_GIB = (8, 12, 16, 24, 24, 40, 48, 80)
REPLICAS = 3
PUBLISH_PERIOD_S = 120.0
RECHECK_PERIOD_S = 120.0
RELOOKUP_EVERY = 10
LOAD_S = 30.0
STORE_BYTES = 48  # a store or read request's framing besides what it carries
JOIN_BYTES = 400  # an identify message: keys, addresses, protocols
HINT_CELL_BYTES = 8  # a locality cell and its count in a Hint
HINT_MIN_RECORDS = 16  # servers with coordinates a Hint's sample must hold to size lanes by


@dataclass(frozen=True)
class Hint:
    """What a server tells a client that joins through it: the swarm's size as it estimates
    it, and how many servers of its sample of the swarm (one shard) lie in each locality cell.
    A client sizes the lanes it reads with it (`cell_servers`) instead of waiting for a shard
    of its own. It is the initial peer's word: a lane sized wrong costs the client route
    quality, or bytes up to what a lane's holder sends (routing.simulate_client's LANE_LIMIT),
    never a wrong route."""

    estimate: float
    census: Counter[Cell]

    @property
    def usable(self) -> bool:
        """Whether the sample is big enough to size lanes by (a server just joined has none)."""
        return self.census.total() >= HINT_MIN_RECORDS

    def cell_servers(self, cell: Cell) -> float:
        """The servers in `cell`: its share of the sample, of the swarm's estimated size."""
        return self.estimate * max(1, self.census[cell]) / max(1, self.census.total())


@dataclass(frozen=True)
class ServerSpec:
    """A server given rather than drawn (peerd bench scale --real starts the same ones as real
    daemons): the seed of its Ed25519 identity, its access delay (routing.netsim's `place`),
    how many blocks it serves and its throughput (tokens/s through its whole span)."""

    seed: bytes
    access_s: float
    span_len: int
    throughput: float


@dataclass
class SimServer:
    keys: KeyPair
    peer_id: str
    kid: int
    span_len: int
    throughput: float
    record: ServerRecord | None = None
    estimate: float = 1.0  # the swarm's size as this server estimated it
    publishes: int = 0
    replicas: dict[int, list[int]] = field(default_factory=dict)
    # The shard this server samples the swarm from, what it holds of it and when it last read.
    view_key: tuple[int, int] = (0, 1)
    view: dict[str, ServerRecord] = field(default_factory=dict)
    view_holder: int | None = None
    view_read_at: float = -math.inf
    view_coords: dict[str, Coords] = field(default_factory=dict)
    cell_estimate: float = 1.0  # servers in our locality cell, as our sample says


@dataclass
class Swarm:
    """The simulated swarm: servers, the records DHT nodes keep, and an event queue."""

    peers: int
    seed: int = 0
    median_rtt_s: float = 0.05
    lane_records: int = LANE_RECORDS
    num_blocks: int = NUM_BLOCKS
    rebalance: bool = True  # False: servers keep the span they chose (no `better_span`)
    rng: random.Random = field(init=False)
    net: Network = field(init=False)
    servers: dict[int, SimServer] = field(default_factory=dict)
    stores: dict[int, dict[int, RecordShard]] = field(default_factory=dict)
    now: float = 0.0
    _events: list[tuple[float, int, str, int]] = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.net = Network(random.Random(self.seed + 1), self.median_rtt_s)

    # --- servers ------------------------------------------------------------------------------

    def new_server(self, spec: ServerSpec | None = None) -> SimServer:
        """A server drawn from volunteers' machines, or the one `spec` gives."""
        if spec is not None:
            keys = create_new_key_pair(spec.seed)
            peer_id = ID.from_pubkey(keys.public_key).to_base58()
            peer = self.net.place(peer_id, spec.access_s)
            server = SimServer(keys, peer_id, peer.kid, spec.span_len, spec.throughput)
        else:
            keys = create_new_key_pair(self.rng.randbytes(32))
            peer_id = ID.from_pubkey(keys.public_key).to_base58()
            peer = self.net.add(peer_id)
            memory = self.rng.choice(GPU_MEMORY_GIB) * GIB * 8 // 10
            span_len = max(1, blocks_that_fit(memory, BLOCK_BYTES, CACHE_BYTES, self.num_blocks))
            speed = self.rng.lognormvariate(7.0, 0.6)  # block steps/s of the device
            server = SimServer(keys, peer_id, peer.kid, span_len, speed / span_len)
        self.servers[peer.kid] = server
        self.stores[peer.kid] = {}
        return server

    def welcome(self, kid: int) -> tuple[Hint, float]:
        """A client joining: a connection to an initial peer, whose first request asks what it
        knows of the swarm (`Hint`); the hint and the seconds it took."""
        initial = self.net.member_near(self.rng.getrandbits(64))
        server = self.servers[initial]
        hint = Hint(
            server.estimate,
            Counter(cell_of(c) for p, c in server.view_coords.items() if p in server.view),
        )
        size = JOIN_BYTES + HINT_CELL_BYTES * len(hint.census)
        return hint, self.net.exchange(kid, initial, STORE_BYTES, size, "join")

    def bootstrap(self, kid: int) -> tuple[float, float]:
        """Joining: a connection to an initial peer (a daemon's `--initial-peers`: a dial, and
        py-libp2p's identify exchange on it), then a Kademlia self look-up; the swarm's
        estimated size and the seconds both took."""
        initial = self.net.member_near(self.rng.getrandbits(64))
        joined = self.net.exchange(kid, initial, JOIN_BYTES, JOIN_BYTES, "join")
        found = self.net.look_up(kid, kid)
        return self.net.estimate_size(found.closest, kid), joined + found.seconds

    def holder_of(self, origin: int, key: int) -> Lookup:
        """Look `key` up from `origin` until a peer that keeps records under it answers."""

        def holds(kid: int) -> int:
            shard = self.stores.get(kid, {}).get(key)
            return sum(len(r) for r in shard.records(self.now)) + 16 if shard else 0

        return self.net.look_up(origin, key, holds)

    def read_view(self, server: SimServer) -> float:
        """Bring the server's sample of the swarm up to date; return the shard count."""
        shards = shard_count(server.estimate)
        index = shard_of(server.peer_id, shards) if server.view_key[1] != shards else None
        if index is not None:  # a new shard count: sample the shard we are in ourselves
            server.view_key, server.view, server.view_read_at = (index, shards), {}, -math.inf
            server.view_coords = {}
        key = kad_id(shard_key(MODEL, *server.view_key))
        if server.view_holder not in self.stores or key not in self.stores[server.view_holder]:
            server.view_holder = self.holder_of(server.kid, key).value_holder
            server.view_read_at = -math.inf
        if server.view_holder is None:
            return shards
        changes = self.stores[server.view_holder][key].changes_since(server.view_read_at, self.now)
        self.net.exchange(server.kid, server.view_holder, STORE_BYTES, changes.size, "read")
        if changes.whole:
            server.view = {}
        for peer_id in changes.gone:
            server.view.pop(peer_id, None)
        for signed in changes.records:
            record, coords = authentic(signed)  # the holder believed it; so do we (signature)
            server.view[record.peer_id] = record
            if coords is not None:
                server.view_coords[record.peer_id] = coords
        server.view_read_at = self.now
        mine = cell_of(self.net.coords(server.kid))
        near = sum(1 for c in server.view_coords.values() if cell_of(c) == mine)
        server.cell_estimate = max(1.0, near * shards)
        return shards

    def sampled_view(self, server: SimServer) -> tuple[SwarmSnapshot, float]:
        shards = self.read_view(server)
        others = tuple(r for p, r in server.view.items() if p != server.peer_id)
        return SwarmSnapshot(MODEL, self.num_blocks, others), shards

    def join(self, server: SimServer) -> None:
        server.estimate, _ = self.bootstrap(server.kid)
        view, shards = self.sampled_view(server)
        self.place(server, choose_blocks(view, server.span_len, server.throughput / shards))

    def place(self, server: SimServer, span: tuple[int, int]) -> None:
        server.record = ServerRecord(
            peer_id=server.peer_id,
            model=MODEL,
            start=span[0],
            end=span[1],
            throughput=server.throughput,
            free_cache_tokens=8192,
            state=ServerState.JOINING,
            version="0.1.0",
            addrs=("/ip4/10.0.0.1/tcp/4001",),
        )
        self.publish(server)
        self.schedule(LOAD_S, "online", server.kid)

    def publish(self, server: SimServer) -> None:
        """Store the server's signed record at the REPLICAS closest peers of its shard key at
        each shard level, and of its cell's lanes its tier (ranked in its sample) belongs to."""
        assert server.record is not None
        record = replace(
            server.record, updated_at=self.now, expires_at=self.now + 2 * PUBLISH_PERIOD_S + 12
        )
        server.record = record
        signed = sign_record(record, server.keys.private_key, self.net.coords(server.kid))
        server.publishes += 1
        coords = self.net.coords(server.kid)
        for shards in shard_levels(shard_count(server.estimate)):
            self._store(server, signed, shard_of(server.peer_id, shards), shards)
        sample = (
            seconds_per_block(r, server.view_coords.get(p))
            for p, r in server.view.items()
            if p != server.peer_id
        )
        tier = tier_of(seconds_per_block(record, coords), sample)
        for lane in lane_tiers(tier, server.cell_estimate):
            self._store(server, signed, 0, 1, cell_of(coords), lane)

    def _store(
        self,
        server: SimServer,
        signed: SignedRecord,
        index: int,
        shards: int,
        cell: Cell | None = None,
        tier: int = 0,
    ) -> None:
        key = kad_id(shard_key(MODEL, index, shards, cell=cell, tier=tier))
        replicas = server.replicas.get(key, [])
        stale = any(kid not in self.stores for kid in replicas)
        if not replicas or stale or server.publishes % RELOOKUP_EVERY == 0:
            replicas = self.net.look_up(server.kid, key).closest[:REPLICAS] or [server.kid]
            server.replicas[key] = replicas
        for replica in replicas:
            if replica != server.kid:
                self.net.exchange(server.kid, replica, len(signed) + STORE_BYTES, 8, "store")
            kept = self.stores[replica]
            if key not in kept:
                kept[key] = RecordShard(MODEL, self.num_blocks, index, shards, cell=cell)
            kept[key].offer(signed, self.now)

    def recheck(self, server: SimServer) -> None:
        assert server.record is not None
        if server.record.state is not ServerState.ONLINE:
            return
        if server.publishes % RELOOKUP_EVERY == 0:
            server.estimate, _ = self.bootstrap(server.kid)
        view, shards = self.sampled_view(server)
        me = replace(server.record, throughput=server.throughput / shards)
        span = better_span(view.with_record(me), me)
        if span is not None:
            self.place(server, span)

    def leave(self, kid: int) -> None:
        self.servers.pop(kid)
        self.net.remove(kid)
        del self.stores[kid]

    # --- events -------------------------------------------------------------------------------

    def schedule(self, delay: float, kind: str, kid: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (self.now + delay, self._seq, kind, kid))

    def handle(self, kind: str, kid: int) -> None:
        server = self.servers.get(kid)
        if server is not None and kind == "join":
            self.start_server(server)
        if server is None or server.record is None:
            return
        if kind == "online" and server.record.state is ServerState.JOINING:
            if self.now >= server.record.updated_at + LOAD_S - 1e-9:
                server.record = replace(server.record, state=ServerState.ONLINE)
                self.publish(server)
        elif kind == "publish":
            self.publish(server)
            self.schedule(PUBLISH_PERIOD_S * self.rng.uniform(0.9, 1.0), "publish", kid)
        elif kind == "recheck":
            self.recheck(server)
            self.schedule(RECHECK_PERIOD_S * self.rng.uniform(0.5, 1.5), "recheck", kid)

    def start_server(self, server: SimServer) -> None:
        self.join(server)
        self.schedule(PUBLISH_PERIOD_S * self.rng.uniform(0.5, 1.0), "publish", server.kid)
        if self.rebalance:
            self.schedule(RECHECK_PERIOD_S * self.rng.uniform(0.5, 1.5), "recheck", server.kid)

    def truth(self) -> SwarmSnapshot:
        records = [s.record for s in self.servers.values() if s.record is not None]
        return SwarmSnapshot(MODEL, self.num_blocks, tuple(records))

    def advance(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            at, _, kind, kid = heapq.heappop(self._events)
            self.now = at
            self.handle(kind, kid)
        self.now = until
