"""The libp2p node of a daemon: a host pinned to Noise + yamux, its Kademlia DHT, and the peer
protocol ids. Every quirk of py-libp2p 0.8.1 that we work around lives here (see
../shared/notes/libp2p.md)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.kad_dht import provider_store
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

log = logging.getLogger(__name__)

INFO_PROTOCOL = TProtocol("/peerd/info/1.0.0")
INFERENCE_PROTOCOL = TProtocol("/peerd/inference/1.0.0")
PUSH_PROTOCOL = TProtocol("/peerd/push/1.0.0")
TRAINING_PROTOCOL = TProtocol("/peerd/training/1.0.0")


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


@dataclass
class Node:
    """A running host and DHT."""

    host: IHost
    dht: KadDHT

    @property
    def peer_id(self) -> ID:
        return self.host.get_id()

    def maddrs(self) -> list[str]:
        """Full dialable multiaddrs, ending in /p2p/<peer id>."""
        pid = self.peer_id.to_string()
        out = []
        for addr in self.host.get_addrs():
            text = str(addr)
            out.append(text if "/p2p/" in text else f"{text}/p2p/{pid}")
        return out

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
        async with background_trio_service(dht):
            yield Node(host, dht)
