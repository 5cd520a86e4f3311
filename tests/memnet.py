"""An in-memory network for tests: real BlockServer objects reached through trio memory streams
instead of libp2p, so servers, push, failover and the client sessions run in one process in
milliseconds.

A MemNet hands out MemNodes: each has a peer id and the part of peerd.node.p2p.Node that the
server and the client side use (`peer_id`, `open_stream`, `remember`, `connection_kind`,
`relayed`). `open_stream(peer, protocol)` makes a memory stream pair and runs the named
in-process server's handler for `protocol` (info, inference, push, training) on one end; the
caller gets the other. `net.kill(name)` stops a server at once: the handlers of its streams are
cancelled, their streams end (the other side reads the end or gets BrokenResourceError, so
MessageStream raises PeerGone), and opening a new stream to it raises PeerUnreachable, as a dead
daemon does. What it does not have: a DHT (`SwarmView.refresh` cannot run over it: put the
records in the view instead), relays, NAT.

A 3-server swarm of a tiny random llama (6 blocks) and a SwarmView over it:

    path = save_tiny_llama(tmp_path)                      # once per module: a fixture
    async with open_memnet() as net:
        for name, (start, end) in {"a": (0, 2), "b": (2, 4), "c": (4, 6)}.items():
            net.serve(name, blocks.load_span(path, start, end))
        client = net.node("client")
        view = SwarmView(client, TINY_MODEL, 6, refresh_period=60)
        view.records = net.records()                      # what a refresh would have found
        async with InferenceSession(view, max_length=32) as session:
            out = await session.step(torch.randn(1, 4, 32))
        net.kill("b")                                     # b's open streams end now

Peer ids are real libp2p ids (ID.from_base58 works on them); `net.peer_id("a")` gives one by name.
The servers' records carry no addresses; `remember` accepts any and ignores them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

import blocks
from peerd.node.p2p import (
    INFERENCE_PROTOCOL,
    INFO_PROTOCOL,
    PUSH_PROTOCOL,
    TRAINING_PROTOCOL,
    PeerUnreachable,
)
from peerd.server.block_server import BlockServer, ServerLimits
from peerd.server.compute import ComputeQueue
from peerd.session.swarm import SwarmView
from routing.records import ServerRecord

TINY_MODEL = "tiny-llama"
TINY_BLOCKS = 6  # tests/test_blocks.py's tiny llama: 6 blocks, hidden size 32
TINY_HIDDEN = 32
READ_CHUNK = 1 << 20

Handler = Callable[["MemoryByteStream", str], Awaitable[None]]


def save_tiny_llama(directory: Path) -> Path:
    """A tiny random llama checkpoint (6 blocks, hidden size 32) saved in `directory`."""
    from tests.tiny_models import save_tiny

    return save_tiny("llama", directory / "llama")


def random_steps(seed: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """Hidden states of the tiny llama for steps of `sizes` tokens (a prompt, then decode
    steps), [1, tokens, TINY_HIDDEN] each, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, TINY_HIDDEN, generator=g) for n in sizes]


def whole_output(whole: blocks.Span, steps: list[torch.Tensor]) -> torch.Tensor:
    """What every block in one span (`whole`) makes of all those tokens as one sequence, in one
    pass: the reference a route of servers must match."""
    with torch.inference_mode():
        return whole(torch.cat(steps, dim=1))


def view_over(net: MemNet, names: Iterable[str] | None = None) -> SwarmView:
    """A client's SwarmView over the net's live servers (of `names` only, if given), its
    records put in as a refresh would have found them."""
    view = SwarmView(net.node("client"), TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]
    view.records = net.records(names)
    return view


class MemoryByteStream:
    """One end of an in-memory stream: read/write/close as a libp2p stream has them, and the
    peer id of the other end (MessageStream reads it from `remote_peer`)."""

    def __init__(
        self,
        send: trio.testing.MemorySendStream,
        receive: trio.testing.MemoryReceiveStream,
        remote_peer: str,
    ) -> None:
        self._send = send
        self._receive = receive
        self.remote_peer = remote_peer

    async def read(self, n: int | None = None) -> bytes:
        return bytes(await self._receive.receive_some(n or READ_CHUNK))

    async def write(self, data: bytes) -> None:
        await self._send.send_all(data)

    async def close(self) -> None:
        self.close_now()
        await trio.lowlevel.checkpoint()

    def close_now(self) -> None:
        """End both directions: the other side reads the end; its writes break."""
        self._send.close()
        self._receive.close()


def stream_pair(dialer: str, listener: str) -> tuple[MemoryByteStream, MemoryByteStream]:
    """(dialer's end, listener's end) of a fresh in-memory stream."""
    to_listener_send, to_listener_receive = trio.testing.memory_stream_one_way_pair()
    to_dialer_send, to_dialer_receive = trio.testing.memory_stream_one_way_pair()
    return (
        MemoryByteStream(to_listener_send, to_dialer_receive, remote_peer=listener),
        MemoryByteStream(to_dialer_send, to_listener_receive, remote_peer=dialer),
    )


@dataclass
class _Served:
    """A server on the net and what a kill must stop: its handlers' scopes, its streams."""

    name: str
    server: BlockServer
    alive: bool = True
    scopes: set[trio.CancelScope] = field(default_factory=set)
    streams: set[MemoryByteStream] = field(default_factory=set)


class MemNode:
    """The part of peerd.node.p2p.Node that servers and client sessions use, over a MemNet."""

    def __init__(self, net: MemNet, name: str, peer_id: ID) -> None:
        self.net = net
        self.name = name
        self.peer_id = peer_id
        self.relayed = False

    async def open_stream(
        self, peer_id: ID, protocol: str, *, optimistic: bool = False
    ) -> MemoryByteStream:
        """(Protocols are not negotiated here: an optimistic stream is like any other.)"""
        await trio.lowlevel.checkpoint()
        return self.net.connect(self, peer_id.to_string(), protocol)

    def remember(self, peer_id: ID, addrs: Iterable[str]) -> None:
        """Addresses mean nothing here: every live server is reachable by its peer id."""

    def connection_kind(self, peer_id: ID) -> str:
        served = self.net.served_by_id(peer_id.to_string())
        return "direct" if served is not None and served.alive else "none"


class MemNet:
    """Named nodes and the BlockServers on them, connected through memory streams."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._nodes: dict[str, MemNode] = {}
        self._served: dict[str, _Served] = {}  # by peer id

    def node(self, name: str) -> MemNode:
        """The node called `name` (made on first use, with a fresh peer id)."""
        if name not in self._nodes:
            peer_id = ID.from_pubkey(create_new_key_pair().public_key)
            self._nodes[name] = MemNode(self, name, peer_id)
        return self._nodes[name]

    def peer_id(self, name: str) -> str:
        return self.node(name).peer_id.to_string()

    def serve(
        self,
        name: str,
        span: blocks.Span,
        *,
        model: str = TINY_MODEL,
        cache_tokens: int = 4096,
        limits: ServerLimits | None = None,
        batching: bool = True,
    ) -> BlockServer:
        """A BlockServer on node `name`, online with `span` and a cache of `cache_tokens`."""
        node = self.node(name)
        server = BlockServer(
            model=model,
            start=span.start,
            end=span.end,
            compute=ComputeQueue(),
            peer_id=node.peer_id.to_string(),
            addrs=list,
            limits=limits,
            node=node,  # type: ignore[arg-type]  # a MemNode has what the server uses of a Node
            batching=batching,
        )
        server.go_online(span, blocks.MemoryCache(budget_tokens=cache_tokens), throughput=1.0)
        self._served[server.peer_id] = _Served(name, server)
        return server

    def server(self, name: str) -> BlockServer:
        return self._served[self.peer_id(name)].server

    def records(self, names: Iterable[str] | None = None) -> dict[str, ServerRecord]:
        """The live records of the servers still alive (of `names` only, if given), by peer id:
        what SwarmView.records holds after a refresh."""
        wanted = None if names is None else {self.peer_id(n) for n in names}
        return {
            peer_id: served.server.record()
            for peer_id, served in self._served.items()
            if served.alive and (wanted is None or peer_id in wanted)
        }

    def served_by_id(self, peer_id: str) -> _Served | None:
        return self._served.get(peer_id)

    def kill(self, name: str) -> None:
        """Stop server `name` now: its handlers are cancelled and all its streams end."""
        served = self._served[self.peer_id(name)]
        served.alive = False
        for scope in served.scopes:
            scope.cancel()
        for stream in served.streams:
            stream.close_now()

    def connect(self, dialer: MemNode, peer_id: str, protocol: str) -> MemoryByteStream:
        """A stream from `dialer` to the server with `peer_id`, its handler for `protocol`
        running on the other end."""
        served = self._served.get(peer_id)
        if served is None or not served.alive:
            raise PeerUnreachable(f"cannot reach peer {peer_id}: not on the memnet or killed")
        handler = _handler(served.server, protocol)
        ours, theirs = stream_pair(dialer.peer_id.to_string(), peer_id)
        served.streams.add(theirs)
        # A stream the server dials (a push) ends with it too.
        if (dialing := self._served.get(dialer.peer_id.to_string())) is not None:
            dialing.streams.add(ours)
        self._nursery.start_soon(self._run_handler, served, handler, theirs)
        return ours

    async def _run_handler(
        self, served: _Served, handler: Handler, stream: MemoryByteStream
    ) -> None:
        with trio.CancelScope() as scope:
            served.scopes.add(scope)
            try:
                await handler(stream, stream.remote_peer)
            finally:
                served.scopes.discard(scope)
                served.streams.discard(stream)
                stream.close_now()


def _handler(server: BlockServer, protocol: str) -> Handler:
    handlers: dict[str, Handler] = {
        INFO_PROTOCOL: server.handle_info,
        INFERENCE_PROTOCOL: server.handle_inference,
        PUSH_PROTOCOL: server.handle_push,
        TRAINING_PROTOCOL: server.handle_training,
    }
    if protocol not in handlers:
        raise PeerUnreachable(f"protocol {protocol} is not offered")
    return handlers[protocol]


@asynccontextmanager
async def open_memnet() -> AsyncIterator[MemNet]:
    """A MemNet whose handler tasks live in a nursery that ends (cancelled) on leaving."""
    async with trio.open_nursery() as nursery:
        net = MemNet(nursery)
        try:
            yield net
        finally:
            nursery.cancel_scope.cancel()
