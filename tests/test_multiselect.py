"""Protocol negotiation in one round trip (peerd.node.multiselect) against py-libp2p's own
listener, in memory and between two real hosts."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.protocol_muxer.multiselect import Multiselect
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

from peerd.node.multiselect import PipelinedMultiselectClient
from peerd.node.p2p import open_node

ECHO = TProtocol("/peerd-test/echo/1")
OTHER = TProtocol("/peerd-test/other/1")


class _Pipe:
    """One end of an in-memory byte stream as py-libp2p's ReadWriteCloser, counting writes."""

    def __init__(self, stream: trio.testing.MemoryStapledStream) -> None:
        self.stream, self.writes = stream, 0

    async def read(self, n: int | None = None) -> bytes:
        return await self.stream.receive_some(n)

    async def write(self, data: bytes) -> None:
        self.writes += 1
        await self.stream.send_all(data)

    async def close(self) -> None:
        await self.stream.aclose()

    def get_remote_address(self) -> None:
        return None


async def _negotiate(
    protocols: list[TProtocol], listener_speaks: list[TProtocol]
) -> tuple[TProtocol | Exception, int]:
    """Our client against py-libp2p's listener: what it selected (or the error), and how many
    writes it took."""
    ours, theirs = (_Pipe(s) for s in trio.testing.memory_stream_pair())
    listener = Multiselect()
    for protocol in listener_speaks:
        listener.add_handler(protocol, None)
    outcome: TProtocol | Exception
    async with trio.open_nursery() as nursery:
        nursery.start_soon(listener.negotiate, MultiselectCommunicator(theirs), 5)
        try:
            outcome = await PipelinedMultiselectClient().select_one_of(
                protocols, MultiselectCommunicator(ours), 5
            )
        except MultiselectClientError as e:
            outcome = e
        nursery.cancel_scope.cancel()
    return outcome, ours.writes


async def test_the_header_and_the_first_proposal_go_in_one_write() -> None:
    assert await _negotiate([ECHO], [ECHO]) == (ECHO, 1)


async def test_a_refused_first_proposal_falls_back_to_the_next_one_by_one() -> None:
    assert await _negotiate([OTHER, ECHO], [ECHO]) == (ECHO, 2)


async def test_no_protocol_in_common_is_an_error_that_names_them() -> None:
    outcome, _ = await _negotiate([OTHER], [ECHO])
    assert isinstance(outcome, MultiselectClientError)
    assert str(OTHER) in str(outcome)


async def test_two_hosts_dial_and_open_streams_with_it() -> None:
    async with AsyncExitStack() as stack:
        a, b = [
            await stack.enter_async_context(
                open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], mdns=False)
            )
            for _ in range(2)
        ]
        for selector in (
            a.host.multiselect_client,  # type: ignore[attr-defined]
            a.host.get_network().upgrader.security_multistream._selector.multiselect_client,  # type: ignore[attr-defined]
            a.host.get_network().upgrader.muxer_multistream._selector.multiselect_client,  # type: ignore[attr-defined]
        ):
            assert isinstance(selector, PipelinedMultiselectClient)

        async def echo(stream) -> None:  # type: ignore[no-untyped-def]
            await stream.write(await stream.read(100))
            await stream.close()

        b.host.set_stream_handler(ECHO, echo)
        await a.connect(PeerInfo(b.peer_id, b.host.get_addrs()))  # security, muxer: pipelined
        for protocols in ([ECHO], [OTHER, ECHO]):
            stream = await a.host.new_stream(b.peer_id, protocols)
            assert stream.get_protocol() == ECHO
            await stream.write(b"ping")
            assert await stream.read(100) == b"ping"
            await stream.close()
        with pytest.raises(StreamFailure):  # refused: the connection stays usable
            await a.host.new_stream(b.peer_id, [OTHER])
        stream = await a.host.new_stream(b.peer_id, [ECHO])
        await stream.write(b"again")
        assert await stream.read(100) == b"again"
