"""A daemon speaks only Noise: a dialer that offers only plaintext or only secio is refused (the
py-libp2p default host would accept both: notes/libp2p.md, pitfall 2), and the daemon goes on
serving Noise dialers."""

from __future__ import annotations

from collections.abc import Mapping

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.abc import ISecureTransport
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.secio import transport as secio

import wire
from peerd.devtools.localswarm import LocalSwarm
from peerd.node.p2p import INFO_PROTOCOL, make_host, parse_peer_maddr
from peerd.node.streams import MessageStream

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LISTEN = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]


def _plaintext(key_pair: KeyPair) -> Mapping[TProtocol, ISecureTransport]:
    return {TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(key_pair)}


def _secio(key_pair: KeyPair) -> Mapping[TProtocol, ISecureTransport]:
    return {TProtocol(secio.ID): secio.Transport(key_pair)}


async def _dial_and_ask_info(host, target: str) -> wire.InfoResponse:  # type: ignore[no-untyped-def]
    peer = parse_peer_maddr(target)
    async with host.run(LISTEN):
        with trio.fail_after(15):
            await host.connect(peer)
            raw = await host.new_stream(peer.peer_id, [INFO_PROTOCOL])
            stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
            await stream.send(wire.InfoRequest())
            reply = await stream.receive(10)
            await stream.close()
    assert isinstance(reply, wire.InfoResponse)
    return reply


@pytest.mark.parametrize("offer", [_plaintext, _secio], ids=["plaintext", "secio"])
async def test_a_dialer_without_noise_is_refused(swarm: LocalSwarm, offer) -> None:  # type: ignore[no-untyped-def]
    daemon = swarm.daemons[0]
    key_pair = create_new_key_pair()
    insecure = new_host(
        key_pair=key_pair,
        sec_opt=offer(key_pair),
        muxer_preference="YAMUX",
        listen_addrs=LISTEN,
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )
    with pytest.raises(Exception) as refused:  # py-libp2p raises several kinds
        await _dial_and_ask_info(insecure, daemon.maddr)
    assert not isinstance(refused.value, AssertionError | trio.TooSlowError), refused.value
    # The daemon goes on serving a dialer that speaks Noise.
    reply = await _dial_and_ask_info(make_host(create_new_key_pair(), LISTEN), daemon.maddr)
    assert reply.record.peer_id == daemon.peer_id
