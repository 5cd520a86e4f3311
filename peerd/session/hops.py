"""One hop of a route: an inference session open on one server for blocks [start, end), reached
over a libp2p stream or, for this daemon's own server, called in process.

What counts against a server is decided here: a dead or silent stream (PeerGone), bytes that are
not a valid message (wire.ProtocolError), an Error reply, a dial that fails or times out, or a
reply to a step we never sent. Any other exception is our own bug and propagates as itself, so
it never bans a healthy server.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

import wire
from blocks import BlocksError
from peerd.node.p2p import INFERENCE_PROTOCOL
from peerd.node.streams import MessageStream, PeerGone
from peerd.session.local import LocalSteps
from routing.planner import RouteHop
from wire.peer_protocol import CompressionName

if TYPE_CHECKING:  # the swarm view asks servers for records with the faults named here
    from peerd.session.swarm import SwarmView

log = logging.getLogger(__name__)

# A step of a 135M-parameter span answers in well under a second; a long prefill on a slow
# volunteer can take longer. Past this the hop counts as failed and is replaced.
# (RouteOptions.request_timeout overrides it per request.)
STEP_TIMEOUT_S = 60.0
# Dialing a server and opening a session on it (RouteOptions.connect_timeout overrides it).
OPEN_TIMEOUT_S = 10.0
# How long a session waits in a full server's queue for cache before trying another server.
ADMISSION_WAIT_S = 10.0

# What opening a stream to a peer raises when the peer, not we, is the problem: unreachable
# (PeerUnreachable is a ConnectionError), too slow, or libp2p's own stream and muxer errors.
DIAL_FAULTS = (OSError, trio.TooSlowError, trio.BrokenResourceError, BaseLibp2pError)
# What a hop's step raises when its server failed us (everything else is our own bug).
PEER_FAULTS = (PeerGone, wire.ProtocolError)


class HopRefused(PeerGone):
    """A live server answered our OpenSession with an error (busy, full, limits)."""


class WrongResult(PeerGone):
    """A server's output failed a spot check (peerd.session.verify): it is banned and replaced."""


async def dial(
    swarm: SwarmView, hop: RouteHop, protocol: TProtocol, timeout: float
) -> MessageStream:
    """A message stream to the hop's server; PeerGone when it cannot be reached in `timeout`."""
    peer = ID.from_base58(hop.peer_id)
    swarm.node.remember(peer, hop.record.addrs)
    try:
        with trio.fail_after(timeout):
            raw = await swarm.node.open_stream(peer, protocol)
    except DIAL_FAULTS as e:
        raise PeerGone(f"cannot reach {hop.peer_id}: {e or type(e).__name__}") from e
    return MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)


@dataclass
class StepReplies:
    """The step ids a hop's stream owes us a reply for, and the one place that tells our reply
    from a late one: a step abandoned by a cancel (Ctrl-C in `peerd chat`) or by a broken push
    chain is still answered by a healthy server, and that answer must be dropped, not read as
    the answer to the next step. A reply to a step we never sent is the server's fault."""

    owed: dict[int, None] = field(default_factory=dict)  # insertion-ordered set

    # Replies that may still come (a push that died half-way may never arrive): kept bounded.
    MAX_OWED = 64

    def sent(self, step_id: int) -> None:
        self.owed[step_id] = None
        while len(self.owed) > self.MAX_OWED:
            del self.owed[next(iter(self.owed))]

    def is_ours(self, reply: wire.StepResult, step_id: int, peer_id: str) -> bool:
        """True for the reply to `step_id`; False for a late reply to an abandoned step (drop
        it); ProtocolError for a reply to no step of ours."""
        if reply.step_id not in self.owed:
            raise wire.ProtocolError(f"{peer_id} answered step {reply.step_id}, never sent")
        del self.owed[reply.step_id]
        if reply.step_id == step_id:
            return True
        log.debug("dropped %s's late reply to abandoned step %d", peer_id, reply.step_id)
        return False


@dataclass
class HopSession:
    """An open session on one remote server for blocks [start, end)."""

    hop: RouteHop
    stream: MessageStream
    session_id: str
    step_ids: itertools.count = field(default_factory=itertools.count)
    timeout: float = STEP_TIMEOUT_S
    replies: StepReplies = field(default_factory=StepReplies)

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    async def step(
        self, hidden: torch.Tensor, codec: CompressionName, start_position: int | None = None
    ) -> torch.Tensor:
        step_id = next(self.step_ids)
        await self.send_step(hidden, codec, step_id, start_position)
        return (await self.receive_result(step_id)).hidden_states

    async def send_step(
        self,
        hidden: torch.Tensor,
        codec: CompressionName,
        step_id: int,
        start_position: int | None = None,
        next_hops: tuple[wire.NextHop, ...] = (),
    ) -> None:
        """Send a step (naming `next_hops` to push it through); it is owed a reply from now."""
        step = wire.Step(
            session_id=self.session_id,
            step_id=step_id,
            hidden_states=hidden,
            start_position=start_position,
            next_hops=next_hops,
        )
        self.replies.sent(step_id)
        # Shielded: a cancel half-way through a frame would leave the stream unreadable for
        # the server, which would then end the session as broken.
        with trio.CancelScope(shield=True):
            try:
                with trio.fail_after(self.timeout):
                    await self.stream.send(step, codec)
            except trio.TooSlowError as e:
                raise PeerGone(f"{self.peer_id} took no step for {self.timeout:.0f} s") from e

    def expect(self, step_id: int) -> None:
        """A step pushed to this hop by the previous server: its reply comes on our stream."""
        self.replies.sent(step_id)

    async def receive_result(self, step_id: int) -> wire.StepResult:
        """The reply to `step_id`, dropping late replies to steps abandoned before it."""
        while True:
            reply = await self.stream.receive(self.timeout)
            if isinstance(reply, wire.Error):
                raise PeerGone(f"{self.peer_id} refused the step: {reply.message}")
            if not isinstance(reply, wire.StepResult):
                raise wire.ProtocolError(
                    f"{self.peer_id} answered step {step_id} with {type(reply).__name__}"
                )
            if self.replies.is_ours(reply, step_id, self.peer_id):
                return reply

    def as_next_hop(self) -> wire.NextHop:
        return wire.NextHop(
            peer_id=self.peer_id,
            addrs=tuple(self.hop.record.addrs),
            session_id=self.session_id,
            start=self.hop.start,
            end=self.hop.end,
        )

    async def close(self) -> None:
        try:
            with trio.move_on_after(1):
                await self.stream.send(wire.CloseSession(session_id=self.session_id))
        except PeerGone:
            pass
        await self.stream.close()


@dataclass
class LocalHopSession:
    """A hop served by this daemon's own block server, called directly."""

    hop: RouteHop
    local: LocalSteps

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    async def step(
        self, hidden: torch.Tensor, codec: CompressionName, start_position: int | None = None
    ) -> torch.Tensor:
        try:
            return await self.local.step(hidden, start_position)
        except (BlocksError, ValueError) as e:
            raise wire.ProtocolError(str(e)) from e

    async def close(self) -> None:
        self.local.close()


Hop = HopSession | LocalHopSession


@dataclass(frozen=True)
class HopOptions:
    """What every hop of one session is opened with."""

    model: str
    max_length: int
    batch_size: int
    codec: CompressionName
    adapter: str | None
    left_padding: tuple[int, ...]
    connect_timeout: float = OPEN_TIMEOUT_S
    request_timeout: float = STEP_TIMEOUT_S


async def open_hop(swarm: SwarmView, hop: RouteHop, options: HopOptions) -> Hop:
    """Open a session on the hop's server: HopRefused when it is alive but says no, PeerGone or
    ProtocolError when it fails."""
    request = wire.OpenSession(
        session_id=uuid.uuid4().hex,
        model=options.model,
        start=hop.start,
        end=hop.end,
        max_length=options.max_length,
        batch_size=options.batch_size,
        reply_compression=options.codec,
        active_adapter=options.adapter,
        wait_timeout=ADMISSION_WAIT_S,
        left_padding=options.left_padding,
    )
    local = swarm.local_server
    if local is not None and hop.peer_id == local.peer_id:
        try:
            return LocalHopSession(hop, local.open_local(request))
        except (BlocksError, wire.ProtocolError) as e:
            raise HopRefused(f"our own server refused the session: {e}") from e
    deadline = trio.current_time() + options.connect_timeout
    stream = await dial(swarm, hop, INFERENCE_PROTOCOL, options.connect_timeout)
    try:
        await stream.send(request)
        # The reply may take the connect time plus the time we offered to wait in its queue.
        wait = max(0.0, deadline - trio.current_time()) + ADMISSION_WAIT_S
        reply = await stream.receive(wait)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.close()
        raise
    if isinstance(reply, wire.Error):
        await stream.close()
        raise HopRefused(f"{hop.peer_id} refused the session: {reply.message}")
    if not isinstance(reply, wire.SessionOpened):
        await stream.close()
        raise wire.ProtocolError(f"expected SessionOpened, got {type(reply).__name__}")
    return HopSession(
        hop=hop, stream=stream, session_id=request.session_id, timeout=options.request_timeout
    )
