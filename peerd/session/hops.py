"""One hop of a route: an inference session open on one server for blocks [start, end), reached
over a libp2p stream or, for this daemon's own server, called in process.

What counts against a server is decided here: a dead or silent stream (PeerGone), bytes that are
not a valid message or a message out of turn (wire.ProtocolError; the conversation's rules in
wire.conversation raise it, and hold every reply to its step's shape and to finite values), an
Error reply, a dial that fails or times out. Some faults cannot be pinned on the server that
shows them (Unattributed): a step pushed into a session ran on what the server before it sent,
and a reply to a step we never sent may be that server's doing; the session is moved, nobody is
banned. Any other exception is our own bug and propagates as itself, so it never bans a healthy
server.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
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
from routing.planner import Route, RouteHop
from wire.conversation import (
    ClientInference,
    LateReply,
    Opened,
    Refused,
    StepDone,
    Unsolicited,
)
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


class StepRefused(PeerGone):
    """A server answered a step with an error, ending its session."""


class LeaseLapsed(StepRefused):
    """The server took back our session's cache while others waited for it (we were idle, or
    held it long): no fault of the server; the session is opened again and replayed."""


class WrongResult(PeerGone):
    """A server's output failed a spot check (peerd.session.verify): it is banned and replaced."""


class Unattributed(PeerGone):
    """A hop's session went wrong in a way that may be another server's doing (a step someone
    pushed into it): the session is moved elsewhere, its server is not banned."""


async def dial(
    swarm: SwarmView, hop: RouteHop, protocol: TProtocol, timeout: float
) -> MessageStream:
    """A message stream to the hop's server; PeerGone when it cannot be reached in `timeout`."""
    peer = ID.from_base58(hop.peer_id)
    swarm.node.remember(peer, hop.record.addrs)
    try:
        with trio.fail_after(timeout):
            raw = await swarm.node.open_stream(peer, protocol, optimistic=True)
    except DIAL_FAULTS as e:
        raise PeerGone(f"cannot reach {hop.peer_id}: {e or type(e).__name__}") from e
    return MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)


@dataclass
class HopSession:
    """An open session on one remote server for blocks [start, end).

    Its conversation (wire.conversation.ClientInference) tells our reply from a late one: a step
    abandoned by a cancel (Ctrl-C in `peerd chat`) or by a broken push chain is still answered by
    a healthy server, and that answer is dropped, not read as the answer to the next step."""

    hop: RouteHop
    stream: MessageStream
    conversation: ClientInference
    # The session's one counter, shared by all its hops: step ids increase over a session
    # whether a step is sent to a server or pushed to it by the one before.
    step_ids: Iterator[int]
    timeout: float = STEP_TIMEOUT_S

    @property
    def upstream(self) -> str | None:
        """The one peer this hop takes pushed steps from (named when it was opened)."""
        return self.conversation.request.upstream

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    @property
    def session_id(self) -> str:
        return self.conversation.session_id

    async def step(
        self,
        hidden: torch.Tensor,
        codec: CompressionName,
        start_position: int | None = None,
        micro_batch: int | None = None,
        reply_last: int | None = None,
    ) -> torch.Tensor:
        step_id = next(self.step_ids)
        await self.send_step(
            hidden, codec, step_id, start_position, micro_batch=micro_batch, reply_last=reply_last
        )
        # In our dtype, whatever floating type the server chose to send.
        return (await self.receive_result(step_id)).hidden_states.to(hidden.dtype)

    async def send_step(
        self,
        hidden: torch.Tensor,
        codec: CompressionName,
        step_id: int,
        start_position: int | None = None,
        next_hops: tuple[wire.NextHop, ...] = (),
        micro_batch: int | None = None,
        queued: bool = False,
        reply_last: int | None = None,
    ) -> None:
        """Send a step (naming `next_hops` to push it through, in the client's group of sessions
        `micro_batch`, the chain's last server to answer with the last `reply_last` positions of
        its output); it is owed a reply from now, after the steps still owed if `queued` (else
        those are given up on)."""
        step = wire.Step(
            session_id=self.session_id,
            step_id=step_id,
            hidden_states=hidden,
            start_position=start_position,
            next_hops=next_hops,
            micro_batch=micro_batch,
            reply_last=reply_last,
        )
        last = None if next_hops else reply_last  # the chain's last server cuts its reply
        self.conversation.sent_step(step_id, tuple(hidden.shape), hidden.dtype, queued, last)
        # Shielded: a cancel half-way through a frame would leave the stream unreadable for
        # the server, which would then end the session as broken.
        with trio.CancelScope(shield=True):
            try:
                with trio.fail_after(self.timeout):
                    await self.stream.send(step, codec)
            except trio.TooSlowError as e:
                raise PeerGone(f"{self.peer_id} took no step for {self.timeout:.0f} s") from e

    def expect(
        self, step_id: int, like: torch.Tensor, queued: bool = False, reply_last: int | None = None
    ) -> None:
        """A step pushed to this hop by the previous server (its input, like every hop's, of
        the shape and dtype of `like`): its reply comes on our stream (after those of the steps
        still owed if `queued`), its last `reply_last` positions only if this hop ends the
        chain of a step that asked for them."""
        self.conversation.sent_step(step_id, tuple(like.shape), like.dtype, queued, reply_last)

    async def receive_result(self, step_id: int) -> wire.StepResult:
        """The reply to `step_id`, dropping late replies to steps abandoned before it; a step
        whose reply we stop waiting for (cancelled, failed) is abandoned in turn."""
        try:
            while True:
                event = self.conversation.received(await self.stream.receive(self.timeout))
                if isinstance(event, Refused):
                    kind = (
                        LeaseLapsed
                        if event.error.code == wire.ErrorCode.LEASE_EXPIRED
                        else StepRefused
                    )
                    raise kind(f"{self.peer_id} refused the step: {event.error.message}")
                if isinstance(event, LateReply):
                    log.debug(
                        "dropped %s's late reply to step %d", self.peer_id, event.result.step_id
                    )
                    continue
                if isinstance(event, Unsolicited):
                    raise Unattributed(
                        f"{self.peer_id} answered step {event.result.step_id}, which we never "
                        f"sent: {self.upstream} pushed it or {self.peer_id} made it up"
                    )
                if not isinstance(event, StepDone) or event.result.step_id != step_id:
                    raise wire.ProtocolError(f"{self.peer_id} answered step {step_id} with {event}")
                return event.result
        except BaseException:
            self.conversation.cancelled(step_id)
            raise

    def as_next_hop(self) -> wire.NextHop:
        """This hop as the target of a push: with its session's push token, so hand it only to
        the server named as this hop's upstream (in a push chain starting before it)."""
        return next_hop(self.hop, self.conversation.request)

    async def close(self) -> None:
        try:
            with trio.move_on_after(1):
                await self.stream.send(self.conversation.closing())
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
        self,
        hidden: torch.Tensor,
        codec: CompressionName,
        start_position: int | None = None,
        micro_batch: int | None = None,  # our own server's steps merge with any
        reply_last: int | None = None,  # nothing travels: the runner keeps what it needs
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


@dataclass
class FirstStep:
    """A session's first step, sent to the route's first hop right behind its OpenSession and
    pushed on while the other hops' sessions open (their servers hold a push that comes before
    its session opened, peerd.server.push): it reaches the first server one round trip
    sooner. `sent` once a route opened with it (RouteKeeper.open_hops)."""

    hidden: torch.Tensor
    step_id: int
    micro_batch: int | None
    reply_last: int | None = None  # wire.Step.reply_last
    sent: bool = False

    def carried_by(self, route: Route, requests: list[wire.OpenSession]) -> wire.Step | None:
        """The Step for the first of the sessions `requests` open on `route`'s hops, pushed
        through the others; None for a route of one hop (nothing to open meanwhile)."""
        if len(route) < 2:
            return None
        return wire.Step(
            session_id=requests[0].session_id,
            step_id=self.step_id,
            hidden_states=self.hidden,
            next_hops=tuple(
                next_hop(hop, request) for hop, request in zip(route[1:], requests[1:], strict=True)
            ),
            micro_batch=self.micro_batch,
            reply_last=self.reply_last,
        )


def last_positions(hidden: torch.Tensor, last: int | None) -> torch.Tensor:
    """The last `last` positions of [batch, tokens, hidden] (all of them for None), as the
    server that ends a chain answers a step with wire.Step.reply_last."""
    return hidden if last is None else hidden[:, -last:]


def next_hop(hop: RouteHop, request: wire.OpenSession) -> wire.NextHop:
    """The session `request` opens (or opened) on the hop's server as the target of a push:
    with its push token, so hand it only to the server named as its upstream."""
    return wire.NextHop(
        peer_id=hop.peer_id,
        addrs=tuple(hop.record.addrs),
        session_id=request.session_id,
        start=hop.start,
        end=hop.end,
        push_token=request.push_token,
    )


def session_request(
    hop: RouteHop, options: HopOptions, upstream: str | None = None
) -> wire.OpenSession:
    """What opens a session on the hop's server, taking pushed steps from `upstream` alone (the
    hop before it; None: no server may push into it) and only with the session's push token,
    fresh from the OS's random source."""
    return wire.OpenSession(
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
        upstream=upstream,
        # With no upstream, nobody ever gets the token: nobody can push into the session.
        push_token=secrets.token_hex(16),
    )


async def open_hop(
    swarm: SwarmView,
    hop: RouteHop,
    options: HopOptions,
    step_ids: Iterator[int],
    upstream: str | None = None,
    *,
    request: wire.OpenSession | None = None,
    first_step: wire.Step | None = None,
) -> Hop:
    """Open a session on the hop's server (`request`, or session_request's), its steps
    numbered from `step_ids`: HopRefused when the server is alive but says no, PeerGone or
    ProtocolError when it fails. `first_step` (to a remote server only) goes right behind the
    OpenSession, without waiting for the answer: the session returned owes its reply."""
    if request is None:
        request = session_request(hop, options, upstream)
    local = swarm.local_server
    if local is not None and hop.peer_id == local.peer_id:
        try:
            return LocalHopSession(hop, local.open_local(request))
        except (BlocksError, wire.ProtocolError) as e:
            raise HopRefused(f"our own server refused the session: {e}") from e
    deadline = trio.current_time() + options.connect_timeout
    stream = await dial(swarm, hop, INFERENCE_PROTOCOL, options.connect_timeout)
    conversation = ClientInference(request)
    try:
        if first_step is None:
            await stream.send(request)
        else:  # one write: the server reads the step with its OpenSession
            stream.queue(request)
            await stream.send(first_step, options.codec)
        # The reply may take the connect time plus the time we offered to wait in its queue.
        wait = max(0.0, deadline - trio.current_time()) + ADMISSION_WAIT_S
        event = conversation.received(await stream.receive(wait))  # Opened or Refused
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.close()
        raise
    if isinstance(event, Refused):
        await stream.close()
        raise HopRefused(f"{hop.peer_id} refused the session: {event.error.message}")
    if isinstance(event, Opened):  # the standing it grants us: `peerd status` shows it
        swarm.standing_seen[hop.peer_id] = (event.reply.standing, time.time())
    session = HopSession(hop, stream, conversation, step_ids, timeout=options.request_timeout)
    if first_step is not None:
        hidden = first_step.hidden_states
        conversation.sent_step(first_step.step_id, tuple(hidden.shape), hidden.dtype)
    return session
