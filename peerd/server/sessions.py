"""The server's side of the inference conversation: one stream is one session, OpenSession, then
Steps (each answered by a StepResult), then CloseSession or the stream's end.

The rules (order of step ids, start positions, who may push) are wire.conversation's
ServerInference; this module moves the messages, admits the session, runs its steps (from the
client's stream and pushed by the previous server) and pushes outputs on. Any error ends the
session with an Error reply and frees its cache; other sessions are untouched.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

import wire
from blocks import SpanSession
from peerd.node.streams import Idle, MessageStream, PeerGone
from peerd.server.admission import AdapterMissing, Lease, Refused
from peerd.server.boundary import OPEN_TIMEOUT_S, SESSION_IDLE_TIMEOUT_S, stream_boundary
from peerd.server.push import Pusher, PushReceiver
from wire.conversation import (
    MAX_PUSHED_QUEUED,
    CloseRequested,
    OpenRequested,
    PushRefused,
    ServerInference,
    StepRequested,
    TooManyPushed,
)

if TYPE_CHECKING:
    from peerd.server.block_server import BlockServer

log = logging.getLogger(__name__)

# How long an evicted session's stream stays open for its client's next step (see _linger).
EVICTED_LINGER_S = 10.0
# A step's result is written shielded from the session's end (a flood of pushes, an evicted
# lease), within this long: a frame cut in half would leave the stream unable to carry the error
# that says why the session ended.
REPLY_WRITE_S = 10.0


@dataclass
class LiveSession:
    """A session open on this server, found by id when a previous server pushes a step."""

    conv: ServerInference
    session: SpanSession
    messages: MessageStream  # the client's session stream: every result goes there
    scope: trio.CancelScope
    lease: Lease  # its hold on the cache; the last step of either kind renews it
    lock: trio.Lock = field(default_factory=trio.Lock)  # one step at a time, from either side
    failure: Refused | None = None
    # Steps pushed by the previous server, in order; the session's own task runs them, so
    # pushed steps of different sessions run concurrently (and merge into one forward). The
    # conversation refuses more than its max_pushed waiting, so the channel never fills.
    pushed: tuple[trio.MemorySendChannel[wire.Step], trio.MemoryReceiveChannel[wire.Step]] = field(
        default_factory=lambda: trio.open_memory_channel[wire.Step](MAX_PUSHED_QUEUED)
    )

    @property
    def request(self) -> wire.OpenSession:
        assert self.conv.request is not None
        return self.conv.request

    def fail(self, failure: Refused) -> None:
        """End the session: its client hears `failure` on its own stream."""
        self.failure = failure
        self.scope.cancel()

    def take_pushed(self, step: wire.Step, sender: str) -> None:
        """Queue a step `sender` pushed; PushRefused if the session does not take it from
        `sender`. Too many waiting ends the session (its client is confused or hostile)."""
        try:
            self.conv.receive_pushed(step, sender)
        except TooManyPushed as e:
            self.fail(Refused(wire.ErrorCode.BAD_REQUEST, str(e)))
            return
        try:
            self.pushed[0].send_nowait(step)
        except trio.BrokenResourceError:  # the session is ending
            log.info("pushed step for closing session %s", step.session_id[:12])


async def _linger(messages: MessageStream) -> None:
    """Keep an evicted session's stream open until its client's next message (dropped) or
    EVICTED_LINGER_S: its next step then goes out and gets the lease_expired error as its
    answer, instead of failing on a closed stream, which a client must blame on the server."""
    with trio.move_on_after(EVICTED_LINGER_S), contextlib.suppress(PeerGone, wire.ProtocolError):
        await messages.receive(EVICTED_LINGER_S)


class InferenceHandler:
    """The inference streams of one BlockServer and the sessions open on them."""

    def __init__(self, server: BlockServer, pusher: Pusher) -> None:
        self.server = server
        self.pusher = pusher
        self.live: dict[str, LiveSession] = {}  # session id -> session, for pushed steps
        self.scopes: set[trio.CancelScope] = set()  # of the open sessions
        self.pushes = PushReceiver(server, self.live)  # the push streams into those sessions

    async def handle(self, messages: MessageStream) -> None:
        conv = ServerInference()
        async with stream_boundary(self.server, messages, "inference"):
            event = conv.receive(await messages.receive(OPEN_TIMEOUT_S, expect=wire.OpenSession))
            assert isinstance(event, OpenRequested)
            try:
                with self.pushes.opening(event.request.session_id):
                    await self._admit(conv, event.request, messages)
            except Refused as e:
                self.server.counters.sessions_refused += 1
                await self.server.refuse(messages, e.code, str(e))
                if e.code == wire.ErrorCode.LEASE_EXPIRED:
                    await _linger(messages)
            finally:
                conv.close()

    async def _admit(
        self, conv: ServerInference, request: wire.OpenSession, messages: MessageStream
    ) -> None:
        """Check the request against the server, wait in turn for cache, then serve."""
        _check_new_id(self.live, request.session_id)
        try:
            self.server.check_open(request)
        except AdapterMissing as e:
            self.server.counters.sessions_refused += 1
            await self.server.refuse(messages, wire.ErrorCode.ADAPTER_NOT_FOUND, str(e))
            return
        assert self.server.cache is not None  # check_open refuses sessions until online
        admission = self.server.admission
        peer = messages.remote_peer
        with admission.session_slot(peer):
            session = await admission.open_session(
                self.server.cache,
                request.batch_size,
                request.max_length,
                request.wait_timeout,
                request.left_padding or None,
                peer=peer,
            )
            # No await before the lease: a request waiting for cache must see it.
            with admission.lease(peer, session.tokens) as lease, session:
                self.server.counters.sessions_opened += 1
                live = LiveSession(conv, session, messages, trio.CancelScope(), lease)
                lease.evict = live.fail
                await self._serve(live)

    async def _serve(self, live: LiveSession) -> None:
        """Hold the session open (its cache, its id for pushes) while its steps run; the caller
        frees its cache."""
        session_id = live.request.session_id
        _check_new_id(self.live, session_id)  # again: another may have opened while we waited
        try:
            with live.scope:
                self.scopes.add(live.scope)
                self.live[session_id] = live
                standing = self.server.standing.of(live.messages.remote_peer)
                opened = live.conv.opened(live.request.max_length, standing)
                lost = self._take_early_push(live)  # (no await since the session went live)
                await live.messages.send(opened)
                if lost is not None:  # its client waits for that step's result: say why not
                    live.fail(
                        Refused(
                            wire.ErrorCode.PUSH_DROPPED,
                            f"step {lost}, pushed into this session by "
                            f"{live.request.upstream} before the session opened here, was not "
                            "kept (too many such steps, or it came too early): send it again",
                        )
                    )
                await self._run_both_lanes(live)
            if live.failure is not None:  # a pushed step broke the session, or its lease lapsed
                raise live.failure
        finally:
            self.live.pop(session_id, None)
            self.scopes.discard(live.scope)

    def _take_early_push(self, live: LiveSession) -> int | None:
        """Queue the step pushed into the session before it opened, if one came from the peer
        the session takes pushes from, with its push token. Otherwise, the id of such a step
        that came but was not kept (PushReceiver.lost), if any: its client waits for it."""
        early = self.pushes.claim(live.request.session_id)
        lost = self.pushes.lost(live.request)
        if early is None:
            return lost
        try:
            live.take_pushed(*early)
        except PushRefused as e:
            log.info("dropped a step pushed before its session opened: %s", e)
            return lost
        return None

    async def _run_both_lanes(self, live: LiveSession) -> None:
        """The client's own steps and the pushed ones, until the client closes; an error of
        either ends both and is raised as itself, not in an exception group."""
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_pushed, live)
            try:
                await self._serve_steps(live)
            except Exception as e:
                error = e
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _serve_steps(self, live: LiveSession) -> None:
        """Steps from the client's own stream. With server-to-server push the client sends
        only to the first hop and this stream stays quiet while pushed steps arrive, so the
        idle deadline counts from the last step of either kind."""
        while True:
            try:
                message = await live.messages.receive(SESSION_IDLE_TIMEOUT_S)
            except Idle:
                if live.lease.idle_s(trio.current_time()) < SESSION_IDLE_TIMEOUT_S:
                    continue
                raise
            event = live.conv.receive(message)
            if isinstance(event, CloseRequested):
                return
            assert isinstance(event, StepRequested)
            await self._process(live, event.step)

    async def _serve_pushed(self, live: LiveSession) -> None:
        """Run the steps pushed for one session, in the order they came; a failure ends the
        session (its client hears why on its own stream)."""
        async with live.pushed[1] as pushed:
            async for message in pushed:
                try:
                    await self._process(live, message, pushed=True)
                except wire.ProtocolError as e:
                    live.fail(Refused(wire.ErrorCode.BAD_REQUEST, str(e)))
                except Refused as e:
                    live.fail(e)
                except PeerGone:  # the session's client went away; its handler cleans up
                    live.scope.cancel()

    async def _process(self, live: LiveSession, message: wire.Step, pushed: bool = False) -> None:
        """Run one step; push the output on when the step names next hops (first, so the next
        server starts at once); answer the client on its session stream."""
        compression = live.request.reply_compression
        peer = live.messages.remote_peer
        hidden = message.hidden_states
        with (
            self.server.admission.inflight(peer, hidden.numel() * hidden.element_size()),
            live.lease.step(),
        ):
            async with live.lock:
                output = await self.server.run_step(
                    live.conv, live.session, message, owner=peer, pushed=pushed
                )
        if output is None:  # a stale pushed step: its client has moved past it
            return
        pushed_on = True
        if message.next_hops:
            pushed_on = await self.pusher.push(message, output, compression)
        elif message.reply_last is not None:  # the chain ends here: what the client asked for
            output = output[:, -message.reply_last :]
        with trio.CancelScope(shield=True), trio.move_on_after(REPLY_WRITE_S):
            await live.messages.send(
                wire.StepResult(
                    session_id=live.request.session_id,
                    step_id=message.step_id,
                    hidden_states=output,
                    push_failed=not pushed_on,
                ),
                compression,
            )


def _check_new_id(live: dict[str, LiveSession], session_id: str) -> None:
    """Refuse a session id that is open already: an earlier server of someone's route learns
    its downstream session ids (next_hops), and must not take one over, nor receive the steps
    pushed into it."""
    if session_id in live:
        raise Refused(
            wire.ErrorCode.BAD_REQUEST,
            f"session id {session_id[:12]}... is open already: open each session with a fresh "
            "random id",
        )
