"""Protocol negotiation in one round trip, or in none for an optimistic stream
(peerd.node.multiselect), against py-libp2p's own listener, in memory and between two real
hosts."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.protocol_muxer.multiselect import Multiselect
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

from peerd.node.multiselect import OptimisticStream, PipelinedMultiselectClient, ProtocolRefused
from peerd.node.p2p import Node, open_node
from peerd.node.streams import MessageStream, PeerGone

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


async def _two_nodes(stack: AsyncExitStack) -> list[Node]:
    return [
        await stack.enter_async_context(
            open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], mdns=False)
        )
        for _ in range(2)
    ]


async def test_two_hosts_dial_and_open_streams_with_it() -> None:
    async with AsyncExitStack() as stack:
        a, b = await _two_nodes(stack)
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


class _NetPipe(_Pipe):
    """A _Pipe with what OptimisticStream asks of a libp2p stream besides reads and writes."""

    protocol: TProtocol | None = None

    def set_protocol(self, protocol: TProtocol) -> None:
        self.protocol = protocol

    async def reset(self) -> None:
        await self.stream.aclose()


async def _optimistic(
    listener_speaks: list[TProtocol], first: bytes | None
) -> tuple[_NetPipe, bytes | Exception]:
    """An optimistic ECHO stream against py-libp2p's listener, whose handler echoes what it
    reads: (our pipe, what our first read gave or raised) after writing `first`
    (None: we read first, and the handler speaks first)."""
    ours, theirs = trio.testing.memory_stream_pair()
    pipe = _NetPipe(ours)
    listener = Multiselect()
    for protocol in listener_speaks:
        listener.add_handler(protocol, None)
    stream = OptimisticStream(pipe, ECHO)  # type: ignore[arg-type]

    async def listen() -> None:
        their_pipe = _Pipe(theirs)
        await listener.negotiate(MultiselectCommunicator(their_pipe), 5)
        await their_pipe.write(b"late" if first is None else await their_pipe.read(100))

    outcome: bytes | Exception
    async with trio.open_nursery() as nursery:
        nursery.start_soon(listen)
        try:
            if first is not None:
                await stream.write(first)
            with trio.fail_after(5):
                outcome = await stream.read(100)
        except StreamError as e:
            outcome = e
        nursery.cancel_scope.cancel()
    return pipe, outcome


async def test_an_optimistic_stream_proposes_its_protocol_with_its_first_write() -> None:
    pipe, echoed = await _optimistic([ECHO], b"hello")
    assert echoed == b"hello"  # the listener took the proposal and handed the rest on
    assert pipe.writes == 1  # header, proposal and message in one write: no round trip
    assert pipe.protocol == ECHO


async def test_an_optimistic_stream_read_before_any_write_sends_the_proposal_alone() -> None:
    pipe, echoed = await _optimistic([ECHO], None)
    assert echoed == b"late"
    assert pipe.writes == 1


async def test_a_refused_optimistic_proposal_ends_the_stream_at_its_first_read() -> None:
    _, outcome = await _optimistic([OTHER], b"hello")
    assert isinstance(outcome, ProtocolRefused)
    assert str(ECHO) in str(outcome)


async def test_a_message_stream_reads_a_refused_optimistic_proposal_as_a_peer_gone() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    listener = Multiselect()
    listener.add_handler(OTHER, None)
    messages = MessageStream(OptimisticStream(_NetPipe(ours), ECHO), 1 << 20, "them")  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(listener.negotiate, MultiselectCommunicator(_Pipe(theirs)), 5)
        with pytest.raises(PeerGone, match="ProtocolRefused"):
            await messages.receive(5)
        nursery.cancel_scope.cancel()


async def test_two_nodes_open_optimistic_streams() -> None:
    async with AsyncExitStack() as stack:
        a, b = await _two_nodes(stack)

        async def echo(stream) -> None:  # type: ignore[no-untyped-def]
            await stream.write(await stream.read(100))
            await stream.close()

        b.host.set_stream_handler(ECHO, echo)
        a.remember(b.peer_id, b.host.get_addrs())
        stream = await a.open_stream(b.peer_id, ECHO, optimistic=True)  # dials first
        assert stream.get_protocol() == ECHO
        await stream.write(b"ping")
        assert await stream.read(100) == b"ping"
        await stream.close()
        refused = await a.open_stream(b.peer_id, OTHER, optimistic=True)
        await refused.write(b"ping")
        with pytest.raises(ProtocolRefused), trio.fail_after(10):
            await refused.read(100)
        stream = await a.open_stream(b.peer_id, ECHO, optimistic=True)  # the connection lives on
        await stream.write(b"again")
        assert await stream.read(100) == b"again"
