"""The hostile peers of `peerd bench attack`: raw streams to a daemon for crafted messages, and a
fake server that joins the swarm, announces blocks 0:10 with a throughput it never measured, and
then either relays every session honestly through the real server of those blocks (to measure
how many routes a lie wins) or answers every step with a hostile reply (wrong width, NaN, a
step id never asked for), the client-side findings of the review.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID

import wire
from peerd import __version__
from peerd.node.p2p import (
    INFERENCE_PROTOCOL,
    INFO_PROTOCOL,
    PUSH_PROTOCOL,
    Node,
    open_node,
    parse_peer_maddr,
)
from peerd.node.streams import Idle, MessageStream, PeerGone
from peerd.session.swarm import SwarmView

if TYPE_CHECKING:
    from peerd.bench.attack import Rig
    from peerd.devtools.localswarm import DaemonProcess

MAX_FRAME = wire.DEFAULT_MAX_FRAME_SIZE
# A claimed throughput no machine has (tokens/s): the review's figure.
LIE = 1e300
# How long a daemon may take to answer a hostile message before we call it silent.
ANSWER_S = 30.0
# How long the honest client may take to route through a fake server (it must discover it in the
# DHT, fetch its record and plan a route with it: a few refresh periods on a loaded machine).
FAKE_PATIENCE_S = 120.0
HOSTILE_MODES = ("wrong_width", "nan", "wrong_step_id")


async def raw_stream(node: Node, daemon: DaemonProcess, protocol: str) -> MessageStream:
    """A fresh libp2p stream from `node` to `daemon` for `protocol`."""
    peer = ID.from_base58(daemon.peer_id)
    node.remember(peer, daemon.maddrs)
    raw = await node.open_stream(peer, protocol)  # type: ignore[arg-type]
    return MessageStream(raw, MAX_FRAME, daemon.peer_id)


async def write_raw(stream: MessageStream, data: bytes | memoryview) -> None:
    """Bytes as they are, framed or not: what MessageStream.send would refuse to make. A daemon
    that refuses a frame from its length may reset the stream while the rest is on its way: the
    next `outcome` then says `closed`."""
    with contextlib.suppress(StreamError, trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.stream.write(bytes(data))


def crafted(kind: str, **body: Any) -> bytes:
    """A frame of message type `kind` carrying `body` as given, tensors encoded raw: our own
    schema refuses to build what a hostile peer sends (empty tensors, NaN), so it is skipped."""
    fields = {
        k: wire.encode_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in body.items()
    }
    return bytes(
        wire.encode_frame({"protocol": wire.PROTOCOL_VERSION, "type": kind, "body": fields})
    )


async def outcome(stream: MessageStream, timeout: float = ANSWER_S) -> str:
    """What the daemon did about our last message: `error:<code>`, the reply's type, `closed`
    (the stream ended), `silent` (nothing within `timeout`) or `garbled`."""
    try:
        reply = await stream.receive(timeout)
    except Idle:
        return "silent"
    except PeerGone:
        return "closed"
    except wire.ProtocolError:
        return "garbled"
    if isinstance(reply, wire.Error):
        return f"error:{reply.code}"
    return type(reply).TYPE


async def open_session(
    node: Node, daemon: DaemonProcess, rig: Rig, max_length: int = 64, **fields: Any
) -> tuple[MessageStream, str, str]:
    """(stream, session id, outcome) of an OpenSession on the daemon's whole span."""
    start, end = (int(x) for x in daemon_span(daemon))
    stream = await raw_stream(node, daemon, INFERENCE_PROTOCOL)
    session_id = f"attack-{time.monotonic_ns()}"
    await stream.send(
        wire.OpenSession(
            session_id=session_id,
            model=rig.model,
            start=start,
            end=end,
            max_length=max_length,
            **fields,
        )
    )
    return stream, session_id, await outcome(stream)


def daemon_span(daemon: DaemonProcess) -> tuple[int, int]:
    assert daemon.span is not None, f"{daemon.name} printed no span"
    return daemon.span


@dataclass
class FakeServer:
    """A peer that claims blocks 0:10 of the model and answers as `mode` says."""

    rig: Rig
    node: Node
    mode: str  # "relay" or one of HOSTILE_MODES
    sessions: int = 0
    steps: int = 0
    errors: list[str] = field(default_factory=list)
    _pushes: dict[str, MessageStream] = field(default_factory=dict)
    _clients: set[MessageStream] = field(default_factory=set)

    async def hang_up(self) -> None:
        """Close every stream a client opened to us: on leaving, the clients hear it at once
        (a vanished peer would cost them a step timeout, which is not what is measured)."""
        for stream in list(self._clients) + list(self._pushes.values()):
            await stream.close()

    def info(self) -> wire.ServerInfo:
        return wire.ServerInfo(
            peer_id=self.node.peer_id.to_string(),
            model=self.rig.model,
            start=0,
            end=10,
            throughput=LIE,
            free_cache_tokens=1 << 20,
            state=wire.ServerState.ONLINE,
            version=__version__,
            addrs=tuple(self.node.maddrs()),
            max_session_length=8192,
        )

    async def handle_info(self, raw: Any) -> None:
        stream = MessageStream(raw, MAX_FRAME)
        with contextlib.suppress(PeerGone, wire.ProtocolError):
            await stream.receive_as(wire.InfoRequest, ANSWER_S)
            await stream.send(wire.InfoResponse(record=self.info()))
        await stream.close()

    async def handle_inference(self, raw: Any) -> None:
        client = MessageStream(raw, MAX_FRAME)
        self._clients.add(client)
        try:
            request = await client.receive_as(wire.OpenSession, ANSWER_S)
            self.sessions += 1
            if self.mode == "relay":
                await self._relay(client, request)
            else:
                await self._hostile(client, request)
        except (PeerGone, wire.ProtocolError) as e:
            self.errors.append(f"{type(e).__name__}: {e}"[:200])
        finally:
            self._clients.discard(client)
            await client.close()

    async def _hostile(self, client: MessageStream, request: wire.OpenSession) -> None:
        await client.send(
            wire.SessionOpened(session_id=request.session_id, max_length=request.max_length)
        )
        while True:
            step = await client.receive(300)
            if not isinstance(step, wire.Step):  # the client closed: it saw through us
                return
            self.steps += 1
            batch, tokens, width = step.hidden_states.shape
            step_id, hidden = step.step_id, torch.zeros(batch, tokens, width)
            if self.mode == "wrong_width":
                hidden = torch.randn(batch, tokens, width + 7)
            elif self.mode == "nan":
                hidden = torch.full((batch, tokens, width), float("nan"))
            else:
                step_id += 1000
            reply = crafted(
                "step_result", session_id=request.session_id, step_id=step_id, hidden_states=hidden
            )
            await write_raw(client, reply)

    async def _relay(self, client: MessageStream, request: wire.OpenSession) -> None:
        """A man in the middle that answers right: it takes the session to s0 and pushes s0's
        outputs on itself, as the hop the client thinks it is."""
        server = await raw_stream(self.node, self.rig.daemons["s0"], INFERENCE_PROTOCOL)
        try:
            await server.send(
                wire.OpenSession(
                    session_id=request.session_id,
                    model=request.model,
                    start=request.start,
                    end=request.end,
                    max_length=request.max_length,
                    batch_size=request.batch_size,
                    reply_compression=request.reply_compression,
                    wait_timeout=request.wait_timeout,
                    left_padding=request.left_padding,
                )
            )
            await client.send(await server.receive(ANSWER_S + request.wait_timeout))
            while True:
                message = await client.receive(300)
                if not isinstance(message, wire.Step):
                    await server.send(message)
                    return
                await self._relay_step(client, server, request, message)
        finally:
            await server.close()

    async def _relay_step(
        self,
        client: MessageStream,
        server: MessageStream,
        request: wire.OpenSession,
        step: wire.Step,
    ) -> None:
        compression = request.reply_compression
        await server.send(
            wire.Step(
                session_id=request.session_id,
                step_id=step.step_id,
                hidden_states=step.hidden_states,
                start_position=step.start_position,
            ),
            compression,
        )
        result = await server.receive_as(wire.StepResult, 60)
        self.steps += 1
        hops = step.next_hops or request.next_hops
        pushed = not hops or await self._push(hops, step.step_id, result.hidden_states)
        await client.send(
            wire.StepResult(
                session_id=request.session_id,
                step_id=step.step_id,
                hidden_states=result.hidden_states,
                push_failed=not pushed,
            ),
            compression,
        )

    async def _push(
        self, hops: tuple[wire.NextHop, ...], step_id: int, hidden: torch.Tensor
    ) -> bool:
        target = hops[0]
        try:
            stream = self._pushes.get(target.peer_id)
            if stream is None:
                peer = ID.from_base58(target.peer_id)
                self.node.remember(peer, target.addrs)
                raw = await self.node.open_stream(peer, PUSH_PROTOCOL)
                stream = self._pushes[target.peer_id] = MessageStream(raw, MAX_FRAME)
            step = wire.Step(
                session_id=target.session_id,
                step_id=step_id,
                hidden_states=hidden,
                next_hops=hops[1:],
                push_token=target.push_token,  # the session's token, as its client gave it us
            )
            with trio.fail_after(5):
                await stream.send(step)
            return True
        except Exception as e:  # as a server does: the client relays instead
            self.errors.append(f"push: {type(e).__name__}: {e}"[:200])
            self._pushes.pop(target.peer_id, None)
            return False


@contextlib.asynccontextmanager
async def fake_server(rig: Rig, mode: str) -> AsyncIterator[FakeServer]:
    """A FakeServer on a node of its own, joined to every daemon and announcing blocks 0:10 in
    the DHT (every second: the daemons look the model up every refresh period)."""
    async with open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as node:
        for daemon in rig.daemons.values():
            with trio.fail_after(30):
                await node.connect(parse_peer_maddr(daemon.maddr))
        fake = FakeServer(rig, node, mode)
        node.host.set_stream_handler(INFO_PROTOCOL, fake.handle_info)
        node.host.set_stream_handler(INFERENCE_PROTOCOL, fake.handle_inference)
        view = SwarmView(node, rig.model, rig.num_blocks, refresh_period=2.0)

        async def announce() -> None:
            while True:
                await view.announce(range(0, 10))
                await trio.sleep(1.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(announce)
            try:
                yield fake
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await fake.hang_up()
