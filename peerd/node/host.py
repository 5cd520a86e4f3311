"""Making the libp2p host of a daemon: Noise and yamux only, one connection per peer, mDNS that
announces addresses a LAN peer can dial; parsing the peer addresses a person types; how long the
DHT keeps provider records. The py-libp2p quirks of building a host live here (notes/libp2p.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.kad_dht import provider_store
from libp2p.network.config import ConnectionConfig
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from peerd.node import yamux_credit, yamux_writes
from peerd.node.multiselect import pipeline_negotiation

# py-libp2p's yamux answers most reads of a small message with a WINDOW_UPDATE frame; credit is
# released the go-yamux way instead, once half the window is read (peerd.node.yamux_credit): one
# frame (an encryption and a socket write) less per message of a decode step on both ends.
yamux_credit.install()
# Frames queued on a connection while another is written go out with the next write, one Noise
# message and socket write for a micro-batch's steps or a merged forward's replies
# (peerd.node.yamux_writes).
yamux_writes.install()

# Seconds a dial (direct or through a relay) may take before the next address is tried.
DIAL_TIMEOUT_S = 5.0


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
    (mplex loses data), with one connection per peer (avoids a 250 ms happy-eyeballs stall),
    negotiating protocols in one round trip (peerd.node.multiselect).
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
    pipeline_negotiation(host)  # one round trip per negotiation, not two
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
