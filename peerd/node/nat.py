"""NAT traversal for the node: AutoNAT verdicts that mean something (a fresh dial-back), circuit
relay v2 limits and the relays that carry a connection, and DCUtR hole punching driven one task per
relayed peer with retries (docs/nat.md). Node (p2p.py) acts on the verdicts."""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import itertools
import logging
import random
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport

from peerd.node.host import DIAL_TIMEOUT_S

log = logging.getLogger(__name__)

# What a reachable daemon gives peers behind NAT: enough circuits for a small home swarm, each
# one short of a long chat's traffic, and reservations refreshed hourly.
RELAY_LIMITS = RelayLimits(
    duration=3600, data=1 << 30, max_circuit_conns=64, max_reservations=32, reservation_ttl=3600
)
# A daemon behind NAT keeps this many relay reservations: one more than needed, so the loss of
# one relay leaves it reachable through the other.
RELAY_RESERVATIONS = 2
# Pauses between hole-punch attempts to one peer reached only through a relay: the first retries
# come fast (a punch is timing-sensitive and can collide with the peer's own attempt), later
# ones back off to a minute, for as long as the peer stays relayed (see HolePuncher).
PUNCH_RETRY_S = (2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
# Up to this many seconds of random delay before each attempt; of two peers the one with the
# larger peer id waits PUNCH_YIELD_S more, so the other usually punches first: both ends drive
# hole punches, and two attempts started at the same moment cross each other (docs/nat.md).
PUNCH_JITTER_S = 1.0
PUNCH_YIELD_S = 3.0
# Seconds to wait for one AutoNAT verdict (py-libp2p waits 30 by default).
AUTONAT_TIMEOUT_S = 8.0
# Run the DHT in client mode behind NAT (peers cannot dial us for DHT queries anyway). Off:
# with it, a NATed server's provider records were not found by other NATed peers in the netns
# test (py-libp2p 0.8.1 client mode; not yet understood), see docs/nat.md.
DHT_CLIENT_WHEN_PRIVATE = False


class Reachability(enum.StrEnum):
    """Whether peers can dial this daemon, as AutoNAT verdicts of other peers say."""

    UNKNOWN = "unknown"  # nobody answered yet: behave as reachable (the old behaviour)
    PUBLIC = "public"  # a peer dialled us back: serve relay circuits and the DHT
    PRIVATE = "private"  # dial-backs failed: reserve relay slots, DHT client only


def is_circuit(addr: multiaddr.Multiaddr | str) -> bool:
    return "/p2p-circuit" in str(addr)


class DialBackAutoNAT(AutoNATService):
    """AutoNAT whose answers mean something. py-libp2p's server dials back with host.connect,
    which returns the connection the asking peer just opened to us, so every peer would be told
    it is reachable. We dial the advertised address afresh: a new TCP connection and a Noise
    handshake that proves the peer is there, closed again without ever joining the swarm (a
    second connection to the peer would make the swarm trim one of them)."""

    @staticmethod
    def _filter_by_observed_ip(addrs: list[bytes], observed_ip: str | None) -> list[bytes]:
        """A peer listening on every interface announces /ip4/0.0.0.0: dial it back at the IP
        its request came from (behind NAT that is its router, which forwards nothing)."""
        if observed_ip is None:
            return []
        concrete = []
        for raw in addrs:
            with contextlib.suppress(Exception):
                addr = multiaddr.Multiaddr(raw)
                if addr.value_for_protocol("ip4") == "0.0.0.0":
                    raw = multiaddr.Multiaddr(
                        str(addr).replace("/ip4/0.0.0.0/", f"/ip4/{observed_ip}/", 1)
                    ).to_bytes()
            concrete.append(raw)
        return AutoNATService._filter_by_observed_ip(concrete, observed_ip)

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        network: Any = self.host.get_network()
        for raw in addrs:
            addr = multiaddr.Multiaddr(raw)
            transport = network.transport_manager.transport_for_dialing(addr)
            if transport is None or is_circuit(addr):
                continue
            try:
                with trio.fail_after(DIAL_TIMEOUT_S):
                    conn = await transport.dial(addr)
                    try:
                        await network.upgrader.upgrade_security(conn, True, peer_id)
                    finally:
                        with contextlib.suppress(Exception):
                            await conn.close()
            except Exception as e:
                log.debug("AutoNAT dial-back to %s at %s failed: %s", peer_id, addr, e)
                continue
            return bytes(raw)
        return None


def connection_kind(host: IHost, peer_id: ID) -> str:
    """How a host is connected to a peer now: "direct", "relayed" or "none"."""
    conns = host.get_network().get_connections(peer_id)
    live = [c for c in conns if not getattr(c, "is_closed", False)]
    if not live:
        return "none"
    if any(not any(is_circuit(a) for a in transport_addrs(c)) for c in live):
        return "direct"
    return "relayed"


class HolePuncher(DCUtRProtocol):
    """py-libp2p's DCUtR, driven one task per peer and retried while the peer stays relayed.

    py-libp2p's own driver walks the relayed peers one after the other and gives each at most
    three attempts, ever: a hopeless punch (through a symmetric NAT: about 25 s per attempt)
    holds up every other peer behind it, and three unlucky attempts (both ends punching at the
    same moment, a peer still starting) leave a pair relayed for good. That made the cone-cone
    pair of tests/test_nat.py stay relayed in some runs. Here every relayed peer gets its own
    task that punches after a short delay (longer on one side of the pair, so the two seldom
    start at once) and retries on the PUNCH_RETRY_S schedule until a direct connection exists
    or the relayed one closes. Once direct, new streams take the
    direct connection (py-libp2p prefers it) and the relayed one is closed."""

    def __init__(self, host: IHost, dial_timeout: int) -> None:
        super().__init__(host, dial_timeout=dial_timeout)
        self._driving: set[ID] = set()
        self._via: dict[ID, str] = {}  # relayed peer -> the relays that carry it

    async def _auto_drive_loop(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                relayed = [p for p in self.host.get_network().connections if self._relayed_only(p)]
                self._note_relays(relayed)
                for peer_id in relayed:
                    if peer_id not in self._driving:
                        self._driving.add(peer_id)
                        nursery.start_soon(self._drive, peer_id)
                await trio.sleep(1.0)

    def _note_relays(self, relayed: list[ID]) -> None:
        """Log which relay carries each relayed connection, when it changes: the evidence of
        which relay a pair depends on (tests/test_nat.py kills that one)."""
        for peer_id in set(self._via) - set(relayed):
            del self._via[peer_id]
        for peer_id in relayed:
            conns = self.host.get_network().get_connections(peer_id)
            # Two peers that dial each other at once can hold two circuits (py-libp2p keeps
            # both when they are young), each through its own relay.
            relays = ", ".join(sorted({r for r in map(relay_of, conns) if r is not None}))
            if relays and self._via.get(peer_id) != relays:
                self._via[peer_id] = relays
                log.info("relayed connection to %s through relay %s", peer_id, relays)

    def _relayed_only(self, peer_id: ID) -> bool:
        return peer_id != self.host.get_id() and connection_kind(self.host, peer_id) == "relayed"

    async def _drive(self, peer_id: ID) -> None:
        yield_s = PUNCH_YIELD_S if self.host.get_id().to_bytes() > peer_id.to_bytes() else 0.0
        try:
            for attempt in itertools.count():
                await trio.sleep(yield_s + random.uniform(0, PUNCH_JITTER_S))
                if not self._relayed_only(peer_id):
                    return
                if peer_id not in self._in_progress:  # else the peer's own punch is under way
                    # Our schedule replaces py-libp2p's budget of three attempts per peer.
                    self._hole_punch_attempts.pop(peer_id, None)
                    try:
                        if await self.initiate_hole_punch(peer_id):
                            log.info("direct connection to %s (hole punch)", peer_id)
                            return
                    except Exception as e:  # the relayed connection went away meanwhile
                        log.debug("hole punch to %s failed: %s", peer_id, e)
                await trio.sleep(PUNCH_RETRY_S[min(attempt, len(PUNCH_RETRY_S) - 1)])
        finally:
            self._driving.discard(peer_id)


@dataclass
class Relay:
    """Circuit relay v2 on one host: the hop service (used only while we are reachable), the
    transport that dials through relays and holds our reservations, and DCUtR, which tries to
    turn every relayed connection into a direct one."""

    protocol: CircuitV2Protocol
    transport: CircuitV2Transport
    dcutr: DCUtRProtocol


_LAN_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
)


def on_a_lan(addr: multiaddr.Multiaddr) -> bool:
    """An RFC 1918 or carrier-grade NAT address: reachable only from its own network."""
    try:
        ip = ipaddress.ip_address(addr.value_for_protocol("ip4"))
    except Exception:
        return False
    return any(ip in net for net in _LAN_NETWORKS)


def relay_of(conn: Any) -> str | None:
    """The peer id of the relay that carries a circuit connection. (py-libp2p names the relay
    in the address of a circuit we dialled but names us in one we accepted, so ask the stream
    the circuit runs on: it is a stream of our connection to the relay.)"""
    # muxer -> secure session -> Noise reader/writer -> raw circuit connection (wrapped for
    # accounting when we dialled it) -> the stream to the relay
    layer = getattr(getattr(conn, "muxed_conn", None), "secured_conn", None)
    for _ in range(4):
        if layer is None or hasattr(layer, "stream"):
            break
        layer = getattr(layer, "_wrapped", None) or getattr(layer, "conn", None)
    stream = getattr(layer, "stream", None)
    relay = getattr(getattr(stream, "muxed_conn", None), "peer_id", None)
    return relay.to_base58() if isinstance(relay, ID) else None


def transport_addrs(conn: Any) -> list[multiaddr.Multiaddr]:
    try:
        return list(conn.get_transport_addresses())
    except Exception:
        return []
