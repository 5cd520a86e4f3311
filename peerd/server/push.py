"""Server-to-server push: the steps a previous server of a client's route pushes to us, and our
outputs pushed on to the next one.

A push stream carries Step messages only and is never answered: results go to the client on its
own session stream. Who may push into a session (the `upstream` its client named, as the push
stream's Noise handshake proved its peer id, with the session's `push_token`) and how many pushed
steps may wait is wire.conversation's ServerInference; a peer breaking those rules gets its
push stream closed, and the session it pushed into is untouched (unless the session's own
upstream floods it, which ends that session).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import trio
from libp2p.peer.id import ID

import wire
from peerd.node.p2p import PUSH_PROTOCOL, Node
from peerd.node.streams import MessageStream, PeerGone
from peerd.server.boundary import SESSION_IDLE_TIMEOUT_S, CountsErrors, stream_boundary
from wire.conversation import same_token

log = logging.getLogger(__name__)

# A push that does not go through in this long is abandoned: the client relays instead.
PUSH_TIMEOUT_S = 5.0
# A step pushed into a session not open here yet waits for it: a client sends its first step
# with the first hop's OpenSession while the other hops' sessions open, so the first server's
# push can come before the client's OpenSession does. It waits EARLY_PUSH_WAIT_S, and, once its
# session's OpenSession came, for as long as that waits for cache. At most EARLY_PUSHES steps
# of EARLY_PUSH_BYTES of hidden states in all wait (one per session), the oldest dropped first,
# and at most a quarter of each from one pushing peer (its own oldest dropped first): a peer
# pushing into sessions that never open holds that much for that long and crowds out no other.
EARLY_PUSH_WAIT_S = 10.0
EARLY_PUSHES = 16
EARLY_PUSH_BYTES = 64 << 20
# A held step dropped (for room, too large, too early) is remembered, without its tensor, for
# DROPPED_MEMORY_S (at most DROPPED_REMEMBERED of them, the oldest forgotten first): should its
# session open after all, its client hears at once that the step is gone (lost), instead of
# waiting out its step timeout for a reply that cannot come, and sends it again.
DROPPED_MEMORY_S = 60.0
DROPPED_REMEMBERED = 256


class TakesPushes(Protocol):
    """A session that pushed steps can be handed to (peerd.server.sessions.LiveSession)."""

    def take_pushed(self, step: wire.Step, sender: str) -> None: ...


@dataclass
class _Early:
    """A pushed step waiting for its session to open here."""

    step: wire.Step
    sender: str
    deadline: float
    size: int


@dataclass
class _Dropped:
    """What is remembered of a held step that was dropped: enough to check, as its session
    opens, that it came from the session's upstream with its push token."""

    step_id: int
    sender: str
    push_token: str | None
    until: float


class PushReceiver:
    """The push streams into one server: each pushed step is handed to its session's task, so
    one session's step never holds up another's; one that comes before its session opened
    waits for it (EARLY_PUSH_WAIT_S)."""

    def __init__(self, server: CountsErrors, live: Mapping[str, TakesPushes]) -> None:
        self.server = server
        self.live = live  # the open sessions by id (InferenceHandler.live)
        self._early: dict[str, _Early] = {}  # by session id, oldest first
        self._opening: set[str] = set()  # sessions whose OpenSession came, not yet open
        self._dropped: dict[str, _Dropped] = {}  # held steps dropped, by session id, oldest first

    async def handle(self, messages: MessageStream) -> None:
        async with stream_boundary(self.server, messages, "push", answer_protocol_errors=False):
            while True:
                step = await messages.receive_as(wire.Step, SESSION_IDLE_TIMEOUT_S)
                live = self.live.get(step.session_id)
                if live is None:
                    self._hold(step, messages.remote_peer)
                    continue
                live.take_pushed(step, messages.remote_peer)

    def _hold(self, step: wire.Step, sender: str) -> None:
        now = trio.current_time()
        for session_id, early in list(self._early.items()):
            if early.deadline < now and session_id not in self._opening:
                self._drop(session_id, "waited too long for its session")
        size = step.hidden_states.numel() * step.hidden_states.element_size()
        if step.session_id in self._early or size > EARLY_PUSH_BYTES // 4:
            self._remember_dropped(step, sender, now)
            log.info("pushed step for unknown session %s dropped", step.session_id[:12])
            return
        self._make_room(size, sender, EARLY_PUSHES // 4, EARLY_PUSH_BYTES // 4)
        self._make_room(size, None, EARLY_PUSHES, EARLY_PUSH_BYTES)
        self._early[step.session_id] = _Early(step, sender, now + EARLY_PUSH_WAIT_S, size)

    def _make_room(self, size: int, sender: str | None, count: int, room: int) -> None:
        """Drop the oldest held steps (`sender`'s, or anyone's) until one more of `size` bytes
        keeps theirs within `count` steps and `room` bytes."""
        held = [k for k, e in self._early.items() if sender is None or e.sender == sender]
        while held and (len(held) >= count or sum(self._early[k].size for k in held) + size > room):
            self._drop(held.pop(0), "for room")

    def _drop(self, session_id: str, why: str) -> None:
        early = self._early.pop(session_id)
        self._remember_dropped(early.step, early.sender, trio.current_time())
        log.info("early pushed step for session %s dropped %s", session_id[:12], why)

    def _remember_dropped(self, step: wire.Step, sender: str, now: float) -> None:
        for session_id, dropped in list(self._dropped.items()):
            if dropped.until < now or len(self._dropped) >= DROPPED_REMEMBERED:
                del self._dropped[session_id]
        self._dropped.pop(step.session_id, None)  # the latest, at the end
        self._dropped[step.session_id] = _Dropped(
            step.step_id, sender, step.push_token, now + DROPPED_MEMORY_S
        )

    @contextmanager
    def opening(self, session_id: str) -> Iterator[None]:
        """While a session's OpenSession waits to be served: a step pushed into it meanwhile
        waits too; whatever still waits when it ends (refused, or the step was never claimed)
        is dropped."""
        self._opening.add(session_id)
        try:
            yield
        finally:
            self._opening.discard(session_id)
            self._early.pop(session_id, None)

    def claim(self, session_id: str) -> tuple[wire.Step, str] | None:
        """The step pushed into `session_id` before it opened, and who pushed it (the
        session checks both as it takes it)."""
        early = self._early.pop(session_id, None)
        return None if early is None else (early.step, early.sender)

    def lost(self, request: wire.OpenSession) -> int | None:
        """The id of a step that the session `request` opens would have taken (from its
        upstream, with its push token) but that was pushed before it opened and dropped here;
        forgotten once asked."""
        dropped = self._dropped.pop(request.session_id, None)
        if (
            dropped is None
            or dropped.until < trio.current_time()
            or request.upstream is None
            or dropped.sender != request.upstream
            or request.push_token is None
            or not same_token(request.push_token, dropped.push_token)
        ):
            return None
        return dropped.step_id


class Pusher:
    """Our outputs pushed to the next hops, one stream per next server, kept while it works."""

    def __init__(self, node: Node | None, max_frame_size: int) -> None:
        self.node = node
        self.max_frame_size = max_frame_size
        self._streams: dict[str, MessageStream] = {}  # next hop's peer id -> stream
        self._locks: dict[str, trio.Lock] = {}

    async def push(self, message: wire.Step, output: torch.Tensor, compression: str) -> bool:
        """Send our output to the next hop as its step; False if that failed."""
        target = message.next_hops[0]
        pushed = wire.Step(
            session_id=target.session_id,
            step_id=message.step_id,
            hidden_states=output,
            start_position=message.start_position,  # a rollback applies on every hop alike
            next_hops=message.next_hops[1:],
            push_token=target.push_token,  # the client gave it to us alone, for this session
            micro_batch=message.micro_batch,  # merged alike on every hop
            reply_last=message.reply_last,  # for the chain's last server
        )
        lock = self._locks.setdefault(target.peer_id, trio.Lock())
        try:
            # Shielded from the pushing session's end: the stream carries every session's pushes
            # to that server, and a frame cut in half would break it for all of them.
            with trio.CancelScope(shield=True), trio.fail_after(PUSH_TIMEOUT_S):
                stream = self._streams.get(target.peer_id)  # (no checkpoint when open)
                if stream is None:
                    async with lock:  # one stream per next server, opened once
                        stream = await self._stream_to(target)
                # The sessions of one merged forward push at once: their steps go to the next
                # server in one write (MessageStream.send), which merges them in turn.
                await stream.send(pushed, compression, gather=True)
            return True
        except Exception as e:  # any failure: the client relays this output itself
            log.info("push to %s failed: %s", target.peer_id, e)
            self._streams.pop(target.peer_id, None)
            return False

    async def _stream_to(self, target: wire.NextHop) -> MessageStream:
        stream = self._streams.get(target.peer_id)
        if stream is None:
            if self.node is None:
                raise PeerGone("this server has no host to push with")
            peer = ID.from_base58(target.peer_id)
            self.node.remember(peer, target.addrs)
            raw = await self.node.open_stream(peer, PUSH_PROTOCOL)
            stream = MessageStream(raw, self.max_frame_size, target.peer_id)
            self._streams[target.peer_id] = stream
        return stream
