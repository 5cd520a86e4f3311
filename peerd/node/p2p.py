"""The libp2p node of a daemon: a host pinned to Noise + yamux, its Kademlia DHT, circuit relay v2
(serving it when reachable, reserving slots when behind NAT), AutoNAT and DCUtR hole punching,
and the peer protocol ids. Every quirk of py-libp2p 0.8.1 that we work around lives here (see
../shared/notes/libp2p.md)."""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import itertools
import logging
import os
import random
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage
from libp2p.host.basic_host import BasicHost
from libp2p.kad_dht import provider_store
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

log = logging.getLogger(__name__)

# py-libp2p's yamux answers every read with a WINDOW_UPDATE frame unless this is off; off, it
# releases credit the go-yamux way (once half the window is read), which saves one frame (an
# encryption and a socket write) per message of a decode step on both ends. It is read at call
# time; an operator's own setting wins.
os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")

INFO_PROTOCOL = TProtocol("/peerd/info/1.0.0")
INFERENCE_PROTOCOL = TProtocol("/peerd/inference/1.0.0")
PUSH_PROTOCOL = TProtocol("/peerd/push/1.0.0")
TRAINING_PROTOCOL = TProtocol("/peerd/training/1.0.0")

# What a reachable daemon gives peers behind NAT: enough circuits for a small home swarm, each
# one short of a long chat's traffic, and reservations refreshed hourly.
RELAY_LIMITS = RelayLimits(
    duration=3600, data=1 << 30, max_circuit_conns=64, max_reservations=32, reservation_ttl=3600
)
# A daemon behind NAT keeps this many relay reservations: one more than needed, so the loss of
# one relay leaves it reachable through the other.
RELAY_RESERVATIONS = 2
# Seconds a dial (direct or through a relay) may take before the next address is tried.
DIAL_TIMEOUT_S = 5.0
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


class PeerUnreachable(ConnectionError):
    """No address of a peer (direct or through a relay) answered."""


class BadMultiaddr(ValueError):
    """A multiaddr given by a person that cannot be dialled."""


def parse_peer_maddr(text: str) -> PeerInfo:
    """Parse `/ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...` into a PeerInfo, with an error that says
    what a valid address looks like."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(text))
    except Exception as e:
        raise BadMultiaddr(
            f"cannot use {text!r} as a peer address ({e}); expected a full multiaddr such as "
            "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... as printed by `peerd start`"
        ) from e


def set_provider_record_ttl(seconds: float) -> None:
    """py-libp2p keeps provider records 48 h and has no un-provide, so a dead server would stay
    listed for two days. Our records are re-provided every refresh period; keeping them a few
    periods makes dead servers fall out of the DHT quickly (notes/libp2p.md, pitfall 6)."""
    provider_store.PROVIDER_RECORD_EXPIRATION_INTERVAL = int(seconds)


def make_host(
    key_pair: KeyPair, listen_addrs: Sequence[multiaddr.Multiaddr], mdns: bool = False
) -> IHost:
    """A host that speaks only Noise (plaintext and secio dialers are refused) and only yamux
    (mplex loses data), with one connection per peer (avoids a 250 ms happy-eyeballs stall).
    With `mdns`, it announces itself on the LAN and puts the peers it hears of in its
    peerstore (dialling them is the daemon's business: join_discovered_peers)."""
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_preference="YAMUX",
        listen_addrs=list(listen_addrs),
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        enable_mDNS=mdns,
    )
    if (discovery := getattr(host, "mDNS", None)) is not None:
        _announce_concrete_addrs(discovery.broadcaster)
    return host


def _announce_concrete_addrs(broadcaster: Any) -> None:
    """py-libp2p's mDNS announces our listen addresses as they are; /ip4/0.0.0.0 (every
    interface) would make a LAN peer dial itself. Announce this machine's IPs instead."""
    resolve = broadcaster._resolve_host_addrs

    def concrete() -> list[str]:
        ips = [ip for ip in broadcaster._get_local_ips() if ":" not in ip]
        out: list[str] = []
        for addr in resolve():
            if "/ip4/0.0.0.0/" in addr:
                out += [addr.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/") for ip in ips]
            else:
                out.append(addr)
        return out

    broadcaster._resolve_host_addrs = concrete


async def join_discovered_peers(node: Node) -> None:
    """Dial every peer mDNS hears of on the LAN and add it to our DHT, until cancelled. The
    discovery callback runs in zeroconf's thread: it hands peers to this task through a
    channel."""
    token = trio.lowlevel.current_trio_token()
    send, receive = trio.open_memory_channel[PeerInfo](256)

    def discovered(peer: PeerInfo) -> None:
        def put() -> None:
            with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
                send.send_nowait(peer)

        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(put)

    peerDiscovery.register_peer_discovered_handler(discovered)
    try:
        async for peer in receive:
            if peer.peer_id == node.peer_id or peer.peer_id in node.host.get_connected_peers():
                continue
            try:
                with trio.fail_after(10):
                    await node.connect(peer)
                log.info("joined %s, found on the LAN", peer.peer_id)
            except Exception as e:  # gone again, or not reachable from here: mDNS re-announces
                log.debug("could not join %s found on the LAN: %s", peer.peer_id, e)
    finally:
        peerDiscovery.unregister_peer_discovered_handler(discovered)


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
    if any(not any(is_circuit(a) for a in _transport_addrs(c)) for c in live):
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
            relays = ", ".join(sorted({r for r in map(_relay_of, conns) if r is not None}))
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


@dataclass
class Node:
    """A running host and DHT, with circuit relay and AutoNAT."""

    host: IHost
    dht: KadDHT
    relay: Relay | None = None
    autonat: AutoNATService | None = None
    reachability: Reachability = Reachability.UNKNOWN
    # Our addresses through relays that hold a reservation for us: relay peer id -> address.
    relayed_addrs: dict[str, str] = field(default_factory=dict)

    @property
    def peer_id(self) -> ID:
        return self.host.get_id()

    def maddrs(self) -> list[str]:
        """Full dialable multiaddrs, ending in /p2p/<peer id>: our listen addresses, then our
        addresses through relays."""
        pid = self.peer_id.to_string()
        out = []
        for addr in self.host.get_addrs():
            text = str(addr)
            if is_circuit(text):
                continue
            out.append(text if "/p2p/" in text else f"{text}/p2p/{pid}")
        return out + sorted(self.relayed_addrs.values())

    @property
    def relayed(self) -> bool:
        """Peers reach us only through relays (we are behind NAT and hold a reservation)."""
        return self.reachability is Reachability.PRIVATE and bool(self.relayed_addrs)

    def connection_kind(self, peer_id: ID) -> str:
        """How we are connected to a peer now: "direct", "relayed" or "none"."""
        return connection_kind(self.host, peer_id)

    def forget_cached_providers(self, key: str) -> None:
        """Drop the provider records of DHT key `key` (hex) that our own store holds, so the
        next find_providers asks the network: py-libp2p answers from the local store alone
        when it holds any record for the key (notes/libp2p.md, pitfall 5)."""
        self.dht.provider_store.providers.pop(bytes.fromhex(key), None)

    async def open_stream(self, peer_id: ID, protocol: TProtocol) -> Any:
        """A new stream to a peer, dialling it first if we hold no connection: through a relay
        when it announced relayed addresses (it is behind NAT), else directly."""
        conns = self.host.get_network().get_connections(peer_id)
        if not any(not getattr(c, "is_closed", False) for c in conns):
            await self.dial(peer_id)
        return await self.host.new_stream(peer_id, [protocol])

    async def dial(self, peer_id: ID) -> None:
        addrs = self.host.get_peerstore().addrs(peer_id)
        # Relays in address order: every daemon tries the same relay first.
        circuits = sorted((a for a in addrs if is_circuit(a)), key=str)
        direct = [a for a in addrs if not is_circuit(a)]
        errors: list[str] = []
        if circuits and await self._dial_relayed(circuits, errors):
            # Behind NAT: its own addresses cannot be dialled from outside its LAN. DCUtR
            # upgrades the relayed connection to a direct one when the NATs allow it.
            return
        if direct:
            try:
                with trio.fail_after(DIAL_TIMEOUT_S):
                    await self.host.connect(PeerInfo(peer_id, direct))
                return
            except Exception as e:
                errors.append(f"{', '.join(map(str, direct))}: {e or type(e).__name__}")
        if self.relay is not None and direct and all(_on_a_lan(a) for a in direct):
            # Only LAN addresses: it is behind NAT, and its relayed addresses may not have
            # reached us yet (DHT provider records carry the addresses a peer had when it first
            # met the DHT node): try the relays we know. (A peer at a public or loopback
            # address that does not answer is gone: no relay will find it.)
            relayed = self._through_known_relays(peer_id)[: RELAY_RESERVATIONS + 1]
            if await self._dial_relayed(relayed, errors):
                return
        raise PeerUnreachable(
            f"cannot reach peer {peer_id}: " + ("; ".join(errors) if errors else "no known address")
        )

    async def _dial_relayed(self, addrs: Iterable[multiaddr.Multiaddr], errors: list[str]) -> bool:
        """Dial through the first circuit address in `addrs` that answers (False if none does,
        or we run no relay transport); each failure is noted in `errors`."""
        if self.relay is None:
            return False
        for addr in addrs:
            try:
                with trio.fail_after(DIAL_TIMEOUT_S):
                    await self.relay.transport.dial(addr)
                return True
            except Exception as e:
                errors.append(f"{addr}: {e or type(e).__name__}")
        return False

    def remember(self, peer_id: ID, addrs: Iterable[str]) -> None:
        """Put a peer's announced addresses (full multiaddrs, as in its record) in the
        peerstore, so a stream to it can be opened even if the DHT never told us them."""
        transports = []
        for text in addrs:
            try:
                info = info_from_p2p_addr(multiaddr.Multiaddr(text))
            except Exception:  # an address we cannot parse is one we cannot dial
                continue
            if info.peer_id == peer_id:
                transports.extend(info.addrs)
        if transports:
            self.host.get_peerstore().add_addrs(peer_id, transports, 3600)

    async def connect(self, peer: PeerInfo) -> None:
        self.host.get_peerstore().add_addrs(peer.peer_id, peer.addrs, 3600)
        await self.host.connect(peer)
        await self.dht.add_peer(peer.peer_id)

    def _through_known_relays(self, peer_id: ID) -> list[multiaddr.Multiaddr]:
        """Addresses of a peer through every peer we are directly connected to (any reachable
        daemon serves relay circuits)."""
        out = []
        for relay in self.host.get_connected_peers():
            if relay == peer_id or not self._listens_where_reached(relay):
                continue
            base = self._direct_addr(relay)
            if base is not None:
                out.append(multiaddr.Multiaddr(f"{base}/p2p/{relay}/p2p-circuit/p2p/{peer_id}"))
        return sorted(out, key=str)

    def _listens_where_reached(self, peer_id: ID) -> bool:
        """We reached the peer at an address it listens on, so others can too: a relay worth a
        reservation. (A peer behind NAT that reached us, or a hole-punched connection, comes
        from its router's port, which is none of its listen addresses.)"""
        conns = self.host.get_network().get_connections(peer_id)
        listening = [str(a).split("/p2p/")[0] for a in self.host.get_peerstore().addrs(peer_id)]
        for conn in conns:
            for addr in _transport_addrs(conn):
                if not is_circuit(addr) and str(addr).split("/p2p/")[0] in listening:
                    return True
        return False

    def _direct_addr(self, peer_id: ID) -> str | None:
        """One transport address of a peer (no /p2p part, no relay)."""
        for addr in self.host.get_peerstore().addrs(peer_id):
            if not is_circuit(addr):
                return str(addr).split("/p2p/")[0]
        return None

    # --- reachability -------------------------------------------------------------------------

    async def check_reachability(self) -> Reachability:
        """Ask the peers we are connected to directly to dial us back (AutoNAT) and act on the
        verdict: reachable -> relay service and DHT server; unreachable -> DHT client and relay
        reservations (`keep_reservations`). No answer keeps the current state."""
        if self.autonat is None:
            return self.reachability
        servers = [
            p for p in self.host.get_connected_peers() if self.connection_kind(p) == "direct"
        ]
        if not servers:
            return self.reachability
        self.autonat.dial_results.clear()
        with trio.move_on_after(AUTONAT_TIMEOUT_S + 1):
            async with trio.open_nursery() as nursery:
                for server in servers:
                    nursery.start_soon(self._ask_autonat, server)
        results = self.autonat.dial_results.values()
        if any(results):
            await self.set_reachability(Reachability.PUBLIC)
        elif results:
            await self.set_reachability(Reachability.PRIVATE)
        return self.reachability

    async def _ask_autonat(self, server: ID) -> None:
        assert self.autonat is not None
        addrs = [a.to_bytes() for a in self.host.get_addrs() if not is_circuit(a)]
        try:
            status, _ = await self.autonat.query_server(server, addrs, timeout=AUTONAT_TIMEOUT_S)
        except Exception as e:  # a peer that does not answer says nothing about us
            log.debug("AutoNAT query to %s failed: %s", server, e)
            self.autonat.dial_results.pop(server, None)
            return
        # We ask only over direct connections, so a refusal means none of our addresses is on
        # the IP the peer sees us at: we are behind NAT, as when its dial-back fails. Any other
        # answer (a bad request, the peer's internal error) says nothing about us.
        verdicts = (AutoNATMessage.OK, AutoNATMessage.E_DIAL_ERROR, AutoNATMessage.E_DIAL_REFUSED)
        if status not in verdicts:
            self.autonat.dial_results.pop(server, None)

    async def set_reachability(self, reachability: Reachability) -> None:
        if reachability is self.reachability:
            return
        log.info("reachability: %s (was %s)", reachability.value, self.reachability.value)
        self.reachability = reachability
        private = reachability is Reachability.PRIVATE
        if self.relay is not None:
            self.relay.protocol.allow_hop = not private
        mode = DHTMode.CLIENT if private and DHT_CLIENT_WHEN_PRIVATE else DHTMode.SERVER
        if self.dht.mode != mode:
            await self.dht.switch_mode(mode)
            # Switching to client mode empties the routing table (py-libp2p 0.8.1): put the
            # peers we are connected to back, or our look-ups would ask nobody.
            for peer in self.host.get_connected_peers():
                with contextlib.suppress(Exception):
                    await self.dht.add_peer(peer)
        if not private:
            self.relayed_addrs.clear()

    async def keep_reservations(self, nursery: trio.Nursery) -> None:
        """While unreachable, hold RELAY_RESERVATIONS reservations on peers that serve relay
        circuits (a reachable peer does), dropping relays we lost the connection to."""
        if self.relay is None or self.reachability is not Reachability.PRIVATE:
            return
        for relay_id in list(self.relayed_addrs):
            if self.connection_kind(ID.from_base58(relay_id)) != "direct":
                log.info("lost relay %s", relay_id)
                del self.relayed_addrs[relay_id]
        for peer in self.host.get_connected_peers():
            if len(self.relayed_addrs) >= RELAY_RESERVATIONS:
                return
            if peer.to_string() in self.relayed_addrs or not self._listens_where_reached(peer):
                continue
            try:
                with trio.fail_after(DIAL_TIMEOUT_S):
                    stream = await self.host.new_stream(peer, [HOP_PROTOCOL])
                    reserved = await self.relay.transport.reserve(stream, peer, nursery)
            except Exception as e:
                log.debug("no relay reservation on %s: %s", peer, e)
                continue
            if not reserved:
                continue
            base = self._direct_addr(peer)
            if base is None:
                continue
            self.relayed_addrs[peer.to_string()] = (
                f"{base}/p2p/{peer}/p2p-circuit/p2p/{self.peer_id.to_string()}"
            )
            log.info("reserved a relay slot on %s", peer)


_LAN_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
)


def _on_a_lan(addr: multiaddr.Multiaddr) -> bool:
    """An RFC 1918 or carrier-grade NAT address: reachable only from its own network."""
    try:
        ip = ipaddress.ip_address(addr.value_for_protocol("ip4"))
    except Exception:
        return False
    return any(ip in net for net in _LAN_NETWORKS)


def _relay_of(conn: Any) -> str | None:
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


def _transport_addrs(conn: Any) -> list[multiaddr.Multiaddr]:
    try:
        return list(conn.get_transport_addresses())
    except Exception:
        return []


@asynccontextmanager
async def open_node(
    key_pair: KeyPair,
    listen_addrs: Sequence[str],
    *,
    dht_server: bool = True,
    mdns: bool = False,
) -> AsyncIterator[Node]:
    addrs = [multiaddr.Multiaddr(a) for a in listen_addrs]
    host = make_host(key_pair, addrs, mdns)
    async with host.run(addrs):
        # The DHT exists before any peer identifies us (notes/libp2p.md, pitfall 8).
        dht = KadDHT(host, DHTMode.SERVER if dht_server else DHTMode.CLIENT)
        protocol = CircuitV2Protocol(host, limits=RELAY_LIMITS, allow_hop=True)
        host.set_stream_handler(HOP_PROTOCOL, protocol._handle_hop_stream)
        host.set_stream_handler(STOP_PROTOCOL_ID, protocol._handle_stop_stream)
        config = RelayConfig(
            roles=RelayRole.HOP | RelayRole.STOP | RelayRole.CLIENT, limits=RELAY_LIMITS
        )
        dcutr = HolePuncher(host, dial_timeout=int(DIAL_TIMEOUT_S))
        autonat = DialBackAutoNAT(cast(BasicHost, host), confirmations=1)
        async with (
            background_trio_service(dht),
            background_trio_service(protocol),
            background_trio_service(dcutr),
        ):
            relay = Relay(protocol, CircuitV2Transport(host, protocol, config), dcutr)
            node = Node(host, dht, relay=relay, autonat=autonat)
            _announce_relayed_addrs(node)
            yield node


def _announce_relayed_addrs(node: Node) -> None:
    """Peers learn our addresses from the host (identify, DHT provider records); behind NAT
    only our addresses through relays are of use to them, so the host lists those too.
    (py-libp2p's own dialer skips /p2p-circuit addresses; Node.dial uses them.)"""
    listen_addrs = node.host.get_addrs

    def with_relayed() -> list[multiaddr.Multiaddr]:
        relayed = [multiaddr.Multiaddr(a) for a in sorted(node.relayed_addrs.values())]
        return [*listen_addrs(), *relayed]

    node.host.get_addrs = with_relayed  # type: ignore[method-assign]
