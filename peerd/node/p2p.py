"""The libp2p node of a daemon: the peer protocol ids, and Node, a running host with its Kademlia
DHT, circuit relay v2 (served when reachable, reservations held when behind NAT), AutoNAT and DCUtR
hole punching: how it dials a peer (directly or through relays) and acts on AutoNAT's verdicts.
Building the host is in host.py, NAT traversal's parts in nat.py; the names the rooms above use
are all importable from here. See ../shared/notes/libp2p.md for the py-libp2p quirks."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage
from libp2p.host.basic_host import BasicHost
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from peerd.node.addresses import announced_addrs, check_announce
from peerd.node.host import (
    DIAL_TIMEOUT_S,
    BadMultiaddr,
    make_host,
    parse_peer_maddr,
    set_provider_record_ttl,
)
from peerd.node.multiselect import OptimisticStream
from peerd.node.nat import (
    AUTONAT_TIMEOUT_S,
    DHT_CLIENT_WHEN_PRIVATE,
    RELAY_LIMITS,
    RELAY_RESERVATIONS,
    DialBackAutoNAT,
    HolePuncher,
    Reachability,
    Relay,
    connection_kind,
    is_circuit,
    on_a_lan,
    transport_addrs,
)

__all__ = [
    "INFERENCE_PROTOCOL",
    "INFO_PROTOCOL",
    "JOINED_PROTOCOL",
    "LEAVING_PROTOCOL",
    "PUSH_PROTOCOL",
    "TRAINING_PROTOCOL",
    "BadMultiaddr",
    "Node",
    "PeerUnreachable",
    "Reachability",
    "join_discovered_peers",
    "make_host",
    "open_node",
    "parse_peer_maddr",
    "set_provider_record_ttl",
]

log = logging.getLogger(__name__)

INFO_PROTOCOL = TProtocol("/peerd/info/1.0.0")
# A server tells the peers it knows that it went online, and that it is leaving (SIGTERM), by
# opening a stream of one of these protocols: the protocol is the whole message, and who sent it
# is the Noise-authenticated peer of the connection (SwarmView.heard_join, heard_leave).
JOINED_PROTOCOL = TProtocol("/peerd/joined/1.0.0")
LEAVING_PROTOCOL = TProtocol("/peerd/leaving/1.0.0")
INFERENCE_PROTOCOL = TProtocol("/peerd/inference/1.0.0")
PUSH_PROTOCOL = TProtocol("/peerd/push/1.0.0")
TRAINING_PROTOCOL = TProtocol("/peerd/training/1.0.0")


# Peers told at once that we joined or leave: enough to be quick, few enough for a small machine.
TELL_CONCURRENCY = 16


class PeerUnreachable(ConnectionError):
    """No address of a peer (direct or through a relay) answered."""


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

    async def provide(self, keys: Iterable[str]) -> None:
        """Announce ourselves as a provider of each DHT key (hex), one after the other; a key
        that fails is logged and left for the caller's next period (serving goes on)."""
        for key in keys:
            try:
                await self.dht.provide(key)
            except Exception as e:  # a DHT hiccup: retried next period
                log.warning("announcing %s failed: %s", key[:12], e)

    def forget_cached_providers(self, key: str) -> None:
        """Drop the provider records of DHT key `key` (hex) that our own store holds, so the
        next find_providers asks the network: py-libp2p answers from the local store alone
        when it holds any record for the key (notes/libp2p.md, pitfall 5)."""
        self.dht.provider_store.providers.pop(bytes.fromhex(key), None)

    async def open_stream(
        self, peer_id: ID, protocol: TProtocol, *, optimistic: bool = False
    ) -> Any:
        """A new stream to a peer, dialling it first if we hold no connection: through a relay
        when it announced relayed addresses (it is behind NAT), else directly.

        `optimistic`: the protocol is proposed with the stream's first write, not in a round
        trip before it returns (peerd.node.multiselect.OptimisticStream): for a request to a
        peer that announced the protocol; a peer that turns out not to speak it ends the
        stream at its first read."""
        network = self.host.get_network()
        conns = network.get_connections(peer_id)
        if not any(not getattr(c, "is_closed", False) for c in conns):
            await self.dial(peer_id)
        if optimistic:
            return OptimisticStream(await network.new_stream(peer_id), protocol)
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
        if self.relay is not None and direct and all(on_a_lan(a) for a in direct):
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
            for addr in transport_addrs(conn):
                if not is_circuit(addr) and str(addr).split("/p2p/")[0] in listening:
                    return True
        return False

    def _direct_addr(self, peer_id: ID) -> str | None:
        """One transport address of a peer (no /p2p part, no relay)."""
        for addr in self.host.get_peerstore().addrs(peer_id):
            if not is_circuit(addr):
                return str(addr).split("/p2p/")[0]
        return None

    # --- telling peers we joined or leave -----------------------------------------------------

    def neighbours(self, also: Iterable[str], limit: int) -> list[ID]:
        """The peers (base58 ids) `also` names, then those we are connected to and those in
        our DHT routing table; ourselves left out, at most `limit`."""
        peers = [ID.from_base58(p) for p in also]
        peers += self.host.get_connected_peers()
        peers += self.dht.routing_table.get_peer_ids()
        return [p for p in dict.fromkeys(peers) if p != self.peer_id][:limit]

    async def tell(self, peers: Iterable[ID], protocol: TProtocol, timeout: float) -> int:
        """Open (and at once close) a stream of `protocol` to each of `peers`, a few at a time,
        all within `timeout` seconds; return how many took it. A peer that is gone or does not
        speak the protocol (an older version) is skipped."""
        told = 0
        limiter = trio.CapacityLimiter(TELL_CONCURRENCY)

        async def tell_one(peer: ID) -> None:
            nonlocal told
            async with limiter:
                try:
                    stream = await self.open_stream(peer, protocol)
                except Exception as e:
                    log.debug("could not tell %s (%s): %s", peer, protocol, e)
                    return
                told += 1
                with trio.move_on_after(1), contextlib.suppress(Exception):
                    await stream.close()

        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    if peer != self.peer_id:
                        nursery.start_soon(tell_one, peer)
        return told

    def on_told(self, protocol: TProtocol, heard: Callable[[ID], Awaitable[None]]) -> None:
        """Call `heard(peer)` for every stream of `protocol` a peer opens to us, `peer` being
        the authenticated peer of the connection (nothing is read from the stream). A failure
        of `heard` is logged and ends that stream only."""

        async def handler(stream: Any) -> None:
            peer = stream.muxed_conn.peer_id
            with trio.move_on_after(1), contextlib.suppress(Exception):
                await stream.close()
            try:
                await heard(peer)
            except Exception:
                log.exception("handling %s from %s failed", protocol, peer)

        self.host.set_stream_handler(protocol, handler)

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


@asynccontextmanager
async def open_node(
    key_pair: KeyPair,
    listen_addrs: Sequence[str],
    *,
    dht_server: bool = True,
    mdns: bool = False,
    announce: Sequence[str] = (),
    public_ip: str | None = None,
) -> AsyncIterator[Node]:
    """A running Node listening on `listen_addrs`. Peers are given our listen addresses with
    "every interface" spelled out as this machine's IPs, `public_ip` with our ports in front;
    `announce` replaces them all (peerd.node.addresses)."""
    check_announce(announce, public_ip)
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
            _advertise(node, list(announce), public_ip)
            yield node


def _advertise(node: Node, announce: list[str], public_ip: str | None) -> None:
    """Peers learn our addresses from the host (identify, DHT provider records, our record):
    give them addresses they can dial (peerd.node.addresses), and behind NAT our addresses
    through relays, which are the only ones of use to them. (py-libp2p's own dialer skips
    /p2p-circuit addresses; Node.dial uses them.)"""
    listen_addrs = node.host.get_addrs
    own = f"/p2p/{node.peer_id.to_string()}"

    def advertised() -> list[multiaddr.Multiaddr]:
        listen = [str(a).split("/p2p/")[0] for a in listen_addrs() if not is_circuit(a)]
        ours = announced_addrs(listen, announce=announce, public_ip=public_ip)
        relayed = sorted(node.relayed_addrs.values())
        return [multiaddr.Multiaddr(a + own) for a in ours] + [
            multiaddr.Multiaddr(a) for a in relayed
        ]

    node.host.get_addrs = advertised  # type: ignore[method-assign]
