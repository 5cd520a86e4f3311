"""A simulated network for routing.simulate: peers with latencies, bandwidths, a Kademlia
routing table each, and look-ups counted hop by hop, message by message and byte by byte.

Latency: every peer sits somewhere on a plane of a few dense regions (continents) behind an
access link of its own; a round trip is the distance between two peers plus both access delays,
scaled so that the median round trip over random pairs is `median_rtt_s` (50 ms by default).
Bandwidth: lognormal per peer (median 20 Mbit/s); a transfer runs at the slower end's speed.

Connections: a request travels on a stream of its own (py-libp2p opens one per request and
negotiates its protocol, STREAM_RTTS), over a connection that the first request between two peers
dials (TCP, then security and muxer negotiation, DIAL_RTTS), as measured between two daemons
(peerd/node/multiselect.py). Only a client's connections are tracked: its clock is what the
report gives; a server's upkeep is counted in messages and bytes, not seconds.

Kademlia: 64-bit ids (the first 8 bytes of the sha-256 of the peer id), k = 20, alpha = 3. A
peer's routing table is drawn lazily from the membership: for each prefix length i it knows k
members of the subtree that shares i bits with it and differs in bit i (all of them when there
are fewer), and keeps them until fewer than half are left (departed peers are dropped as if
their failure had been noticed). A look-up is the daemon's (peerd.node.lookup): the alpha
closest peers it knows are asked for the k closest they know, each answer taken as it comes
(a peer an answer makes one of the alpha closest is asked at once, no round waits for its
slowest query), until the alpha closest known have all answered, or until it reaches a peer
holding the value it looks for. A client (not a DHT member) starts from the peers it knows.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

K = 20
ALPHA = 3
ID_BITS = 64
# Bytes of a Kademlia message on the wire: a request (type, key, framing) and one peer entry of
# a reply (id, two multiaddrs, protobuf framing).
REQUEST_BYTES = 80
PEER_ENTRY_BYTES = 90
REGIONS = 5
# Round trips a daemon spends before a request's own (measured between two network namespaces
# 50 ms apart, peerd/node/multiselect.py): dialling a peer (TCP 1, multistream-select for the
# security protocol 1, Noise XX 1.5, multistream-select for the muxer 1), and opening a stream.
DIAL_RTTS = 4.3
STREAM_RTTS = 1.1
# Relative error of each network coordinate (Vivaldi's estimates are typically 10-20% off).
COORD_ERROR = 0.15


def kad_id(name: str | bytes) -> int:
    data = name.encode() if isinstance(name, str) else name
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


@dataclass
class SimPeer:
    name: str
    kid: int
    x: float
    y: float
    access_s: float
    bandwidth: float  # bytes/s
    coord_error: tuple[float, float, float]
    # What the peer sent and received, for upkeep figures.
    messages: int = 0
    bytes: int = 0


@dataclass
class Lookup:
    """What one look-up cost and found."""

    closest: list[int]
    value_holder: int | None
    messages: int
    bytes: int
    hops: int
    seconds: float


@dataclass
class Network:
    """The peers and their Kademlia membership; all randomness from `rng`."""

    rng: random.Random
    median_rtt_s: float = 0.05
    peers: dict[int, SimPeer] = field(default_factory=dict)
    _sorted: list[int] = field(default_factory=list)
    _scale: float = 1.0
    _tables: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    # A client's open connections: client -> the peers it has dialled (module docstring).
    _links: dict[int, set[int]] = field(default_factory=dict)

    def add(self, name: str, *, member: bool = True) -> SimPeer:
        """A new peer; a `member` joins the DHT (a client looks things up but stores nothing)."""
        rng = self.rng
        cx, cy = (rng.randrange(REGIONS) * 0.2, rng.randrange(2) * 0.5)
        x, y = cx + rng.gauss(0, 0.04), cy + rng.gauss(0, 0.04)
        return self.place(name, rng.lognormvariate(math.log(0.004), 0.6), x=x, y=y, member=member)

    def place(
        self, name: str, access_s: float, *, x: float = 0.0, y: float = 0.0, member: bool = True
    ) -> SimPeer:
        """A new peer at a given point and access delay (its bandwidth and coordinate error
        drawn). Peers all placed at one point are a star: a round trip between two is twice the
        sum of their access delays (times the scale; 1 unless calibrated), what a delay on each
        host's own link realises (peerd bench scale --real)."""
        rng = self.rng
        peer = SimPeer(
            name,
            kad_id(name),
            x,
            y,
            access_s,
            rng.lognormvariate(math.log(20e6 / 8), 0.7),
            (rng.gauss(0, COORD_ERROR), rng.gauss(0, COORD_ERROR), rng.gauss(0, COORD_ERROR)),
        )
        self.peers[peer.kid] = peer
        if member:
            bisect.insort(self._sorted, peer.kid)
        else:
            self._links[peer.kid] = set()
        return peer

    def remove(self, kid: int) -> None:
        self.peers.pop(kid)
        self._links.pop(kid, None)
        for links in self._links.values():
            links.discard(kid)
        at = bisect.bisect_left(self._sorted, kid)
        if at < len(self._sorted) and self._sorted[at] == kid:
            del self._sorted[at]

    def member_near(self, target: int) -> int:
        """The DHT member whose id follows `target` (a random member, for a random target)."""
        at = bisect.bisect_left(self._sorted, target) % len(self._sorted)
        return self._sorted[at]

    def calibrate(self, samples: int = 4000) -> None:
        """Scale round trips so that the median over random pairs is `median_rtt_s`."""
        self._scale = 1.0
        kids = list(self.peers)
        pairs = [self.rtt(*self.rng.sample(kids, 2)) for _ in range(samples)]
        self._scale = self.median_rtt_s / sorted(pairs)[len(pairs) // 2]

    def rtt(self, a: int, b: int) -> float:
        pa, pb = self.peers[a], self.peers[b]
        distance = math.hypot(pa.x - pb.x, pa.y - pb.y)
        return self._scale * (0.3 * distance + 2 * (pa.access_s + pb.access_s))

    def coords(self, kid: int) -> tuple[float, float, float]:
        """The peer's network coordinates (x, y, height in seconds) as Vivaldi would settle
        them: the true ones, each off by a relative error of about COORD_ERROR."""
        peer = self.peers[kid]
        ex, ey, eh = peer.coord_error
        return (
            self._scale * 0.3 * peer.x * (1 + ex),
            self._scale * 0.3 * peer.y * (1 + ey),
            max(0.0, self._scale * 2 * peer.access_s * (1 + eh)),
        )

    def transfer_s(self, a: int, b: int, size: int) -> float:
        return size / min(self.peers[a].bandwidth, self.peers[b].bandwidth)

    def exchange(self, a: int, b: int, sent: int, received: int, kind: str) -> float:
        """One request of `sent` bytes from a and its reply of `received` bytes: both peers'
        counters move, and the seconds until the reply is in come back (a stream opened first,
        and a connection dialled first when client `a` has none to b)."""
        for kid in (a, b):
            peer = self.peers[kid]
            peer.messages += 1
            peer.bytes += sent + received
        self.counts[kind] += 2
        self.counts[f"{kind}_bytes"] += sent + received
        before = STREAM_RTTS
        links = self._links.get(a)
        if links is not None and b not in links:
            links.add(b)
            before += DIAL_RTTS
        return (1 + before) * self.rtt(a, b) + self.transfer_s(a, b, sent + received)

    def measured_rtt(self, a: int, b: int, sent: int, received: int) -> float:
        """The round trip `a` measures of an exchange with b: from its request to the reply,
        on a stream already open (what a daemon records, peerd.session.swarm)."""
        return self.rtt(a, b) + self.transfer_s(a, b, sent + received)

    # --- Kademlia -----------------------------------------------------------------------------

    def _subtree(self, target: int, prefix_bits: int) -> tuple[int, int]:
        """Index range in the sorted ids of the subtree sharing `prefix_bits` bits with target."""
        shift = ID_BITS - prefix_bits
        low = (target >> shift) << shift if prefix_bits else 0
        high = low + (1 << shift)
        return bisect.bisect_left(self._sorted, low), bisect.bisect_left(self._sorted, high)

    def closest(self, target: int, count: int = K) -> list[int]:
        """The `count` members closest to target by XOR (what the full network knows): they lie
        in the deepest subtree around target that holds at least `count` members."""
        low, high = 0, ID_BITS  # subtree sizes shrink as the prefix grows: binary search
        while low < high:
            bits = (low + high + 1) // 2
            lo, hi = self._subtree(target, bits)
            if hi - lo >= count:
                low = bits
            else:
                high = bits - 1
        lo, hi = self._subtree(target, low)
        return sorted(self._sorted[lo:hi], key=lambda kid: kid ^ target)[:count]

    def known_closest(self, node: int, target: int) -> list[int]:
        """The k peers closest to target in `node`'s routing table."""
        if node == target:
            return self.closest(target)[:K]
        bit = ID_BITS - (node ^ target).bit_length()  # the bucket target falls in
        known = self._bucket(node, bit)
        if len(known) < K:  # a thin bucket: add our own side's nearest
            known = known + self._bucket(node, -1)[: K - len(known)]
        return heapq.nsmallest(K, known, key=lambda kid: kid ^ target)

    def _bucket(self, node: int, bit: int) -> list[int]:
        """Bucket `bit` of `node`'s table: up to k members of the subtree that shares `bit` bits
        with node and differs in the next. Kept between look-ups like a real table: departed
        peers drop out of it, and it is drawn again from the membership of the day only when
        fewer than half of its k remain (so peers that joined since are known only then)."""
        cached = self._tables.get((node, bit))
        if bit < 0:  # our own neighbourhood: the k closest to us
            if cached is None or any(kid not in self.peers for kid in cached):
                cached = self._tables[(node, bit)] = [p for p in self.closest(node) if p != node]
            return cached
        if cached is not None:
            alive = [kid for kid in cached if kid in self.peers]
            if len(alive) >= min(K // 2, len(cached)):
                if len(alive) < len(cached):
                    self._tables[(node, bit)] = alive
                return alive
        lo, hi = self._subtree(node ^ (1 << (ID_BITS - 1 - bit)), bit + 1)
        if hi - lo <= K:
            known = self._sorted[lo:hi]
        else:
            known = [self._sorted[i] for i in self.rng.sample(range(lo, hi), K)]
        self._tables[(node, bit)] = known
        return known

    def known(self, origin: int) -> frozenset[int] | None:
        """The peers a client knows (those it has dialled); None for a DHT member, which
        knows its routing table."""
        links = self._links.get(origin)
        return None if links is None else frozenset(links)

    def look_up(
        self,
        origin: int,
        target: int,
        holds: Callable[[int], int] | None = None,
        start: frozenset[int] | None = None,
    ) -> Lookup:
        """An iterative look-up from `origin`; `holds(kid)` is the size of the value a peer
        holds under target (0: none), when looking for a value. A client's look-up starts from
        the peers it knew when it began (`start`, what `known` said then: look-ups side by
        side do not learn from each other), a member's from its routing table."""
        if start is not None:
            alive = (kid for kid in start if kid in self.peers)
            first = heapq.nsmallest(K, alive, key=lambda kid: kid ^ target)
        else:
            first = self.known_closest(origin, target)
        shortlist = [p for p in first if p != origin]
        queried: set[int] = {origin}
        depth = dict.fromkeys(shortlist, 1)  # a peer named by a reply is one hop further
        flying: list[tuple[float, int]] = []  # (when its answer is in, peer)
        messages = size = hops = 0
        now = 0.0
        while True:
            for peer in [p for p in shortlist[:ALPHA] if p not in queried]:
                queried.add(peer)
                value = holds(peer) if holds else 0
                reply = value or K * PEER_ENTRY_BYTES
                took = self.exchange(origin, peer, REQUEST_BYTES, reply, "kademlia")
                heapq.heappush(flying, (now + took, peer))
                messages += 2
                size += REQUEST_BYTES + reply
            if not flying:
                break
            now, peer = heapq.heappop(flying)
            hops = max(hops, depth[peer])
            if holds and holds(peer):
                return Lookup(shortlist, peer, messages, size, hops, now)
            named = set(self.known_closest(peer, target)) - {origin}
            for kid in named - set(depth):
                depth[kid] = depth[peer] + 1
            shortlist = heapq.nsmallest(K, set(shortlist) | named, key=lambda kid: kid ^ target)
            # Done once the ALPHA closest known have all answered: answers still on their way
            # come from farther peers (and peers storing under one key pick the same replicas).
            if all(p in queried and p not in (f[1] for f in flying) for p in shortlist[:ALPHA]):
                break
        return Lookup(shortlist, None, messages, size, hops, now)

    def estimate_size(self, closest: list[int], target: int) -> float:
        """Network size estimated from the k closest ids to target a look-up found."""
        if not closest:
            return 1.0
        farthest = max(kid ^ target for kid in closest) + 1
        return len(closest) * (1 << ID_BITS) / farthest
