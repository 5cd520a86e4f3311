"""The inference conversation (with push) as sans-IO state machines, one per role (training's is
wire.training_conversation). Feed each message in, get an event out, or a ConversationError
saying which rule broke.

Nothing here reads or writes: the server's handlers and the client's sessions move the messages
and act on the events, so every ordering rule of docs/wire.md lives here, once.

Inference, server side (`ServerInference`, one per session stream):

    conv = ServerInference()
    event = conv.receive(message)      # OpenRequested | StepRequested | CloseRequested
    reply = conv.opened(max_length)    # the session is admitted: send reply (SessionOpened)
    conv.receive_pushed(step, sender)  # a step pushed by another server: StepRequested(pushed)
    if conv.start_step(step, pushed=...):   # right before running it: order and positions
        ... run it ...                 # False: a stale pushed step, drop it

Rules: OpenSession first; then Steps and at most one CloseSession, all naming the session's id.
Step ids strictly increase over the whole session (steps sent by the client and steps pushed to
it, in the order they run): a client draws them from one counter per session, whichever way a
step reaches the server. `start_position` may not pass the cached tokens, and no step may bring
the session past its max_length. A pushed step is taken only for an open session, only from the
peer the client named as `upstream` in OpenSession (from any peer when it named none), and at
most `max_pushed` may wait; when it named a `push_token`, the pushed step must carry it (compared
in constant time); one whose id is not past the last step run is stale (the client
moved on and sent that step's successor itself) and dropped without error.

Inference, client side (`ClientInference`, one per server session):

    conv = ClientInference(request)    # the OpenSession sent
    conv.received(reply)               # Opened | Refused
    conv.sent_step(step_id, shape)     # a Step sent to this server, or pushed to it for us
    conv.received(reply)               # StepDone | LateReply | Unsolicited | Refused
    conv.cancelled(step_id)            # gave up on that step's reply (Ctrl-C, a broken chain)

Steps are answered in the order sent. Sending a step gives up on every earlier one still
unanswered, unless it is `queued` behind them (a prompt pipelined in chunks: several steps in
flight, their replies owed in order).
A reply to a step given up on is a LateReply, to drop: the server is healthy, only slow. A reply
to a step never sent is UnexpectedReply (the server is confused or lying) when nobody may push
into the session; when its `upstream` may, it is Unsolicited: that upstream (or the server) ran
a step we never sent, which nothing on our side can pin on either, so the client blames neither
and stops trusting the session's cache. A StepDone's hidden states have the shape of the step's
input (every span maps [batch, tokens, hidden] to the same shape), or hold its last positions
only where the step asked the chain's last server for them (Step.reply_last), and are finite;
anything else is BadReply.

Push and `upstream`: a client that pushes names, in each hop's OpenSession, the hop before it as
`upstream`, and draws a fresh `push_token` for it that only the NextHop naming the session
carries, so no one else can push into the session. The server closes a push stream that breaks
this without telling anyone (push streams are never answered), so the step never reaches that
hop: after replacing a hop, push only as far as the next hop that named it, and relay the rest.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass, field

import torch

from wire.errors import ProtocolError
from wire.fields import all_finite
from wire.peer_protocol import (
    CloseSession,
    Error,
    ErrorCode,
    OpenSession,
    SessionOpened,
    Step,
    StepResult,
)
from wire.schema import Message

# Pushed steps one session may have waiting. A client sends a session's next step only once it
# has the last one's result, or a prompt in a few chunks at once (at most 4,
# peerd.session.steps.PIPELINE_MAX_CHUNKS), so more than that queued means a confused or hostile
# peer.
MAX_PUSHED_QUEUED = 8


class ConversationError(ProtocolError):
    """A valid message that breaks a conversation's rules; `code` is the Error code to answer."""

    code: ErrorCode = ErrorCode.BAD_REQUEST


class OutOfTurn(ConversationError):
    """A message this side does not take in the conversation's present phase."""


class WrongSession(ConversationError):
    """A message naming another session than the one of this conversation."""


class StepOutOfOrder(ConversationError):
    """A step id not past the last one of the session."""


class BadStartPosition(ConversationError):
    """A step starting past the cached tokens or reaching past the session's max_length."""


class PushRefused(ConversationError):
    """A pushed step from a peer other than the session's upstream, or for no open session."""


class TooManyPushed(ConversationError):
    """More pushed steps waiting for one session than may."""


class UnexpectedReply(ConversationError):
    """A reply to a request this side never sent (or of the wrong kind)."""


class BadReply(ConversationError):
    """A step's reply whose hidden states are not what the step must give back: another shape
    than its input's, or values that are not finite (NaN, inf)."""


class Phase(enum.Enum):
    AWAITING_OPEN = "awaiting_open"  # server: nothing received yet
    OPENING = "opening"  # OpenSession sent or received, no answer yet
    OPEN = "open"
    CLOSED = "closed"


# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenRequested:
    request: OpenSession


@dataclass(frozen=True)
class StepRequested:
    step: Step
    pushed: bool = False  # came over a push stream from the upstream server


@dataclass(frozen=True)
class CloseRequested:
    pass


@dataclass(frozen=True)
class Opened:
    reply: SessionOpened


@dataclass(frozen=True)
class StepDone:
    result: StepResult


@dataclass(frozen=True)
class LateReply:
    """The reply to a step given up on: drop it and read on."""

    result: StepResult


@dataclass(frozen=True)
class Unsolicited:
    """A reply to a step this client never sent, on a session another server may push into: a
    step ran there that we did not ask for, so the session's cache is no longer ours."""

    result: StepResult


@dataclass(frozen=True)
class Refused:
    """The server refused the request or ended the session; the conversation is over."""

    error: Error


ServerEvent = OpenRequested | StepRequested | CloseRequested
ClientEvent = Opened | StepDone | LateReply | Unsolicited | Refused


def _out_of_turn(who: str, message: Message, phase: Phase, expected: str) -> OutOfTurn:
    return OutOfTurn(
        f"{who} expected {expected} while the session is {phase.value}, got "
        f"{type(message).__name__}"
    )


# --- inference, server side ---------------------------------------------------------------------


@dataclass
class ServerInference:
    """The server's side of one inference session: its client's stream and the steps pushed to
    it. See the module docstring for the rules."""

    max_pushed: int = MAX_PUSHED_QUEUED
    phase: Phase = Phase.AWAITING_OPEN
    request: OpenSession | None = None
    max_length: int = 0  # tokens reserved (from `opened`)
    position: int = 0  # tokens cached once the steps started so far have run
    last_step_id: int = -1
    pushed_waiting: int = 0

    def receive(self, message: Message) -> ServerEvent:
        """A message from the client's own stream."""
        if self.phase is Phase.AWAITING_OPEN:
            if not isinstance(message, OpenSession):
                raise _out_of_turn("the server", message, self.phase, "OpenSession")
            self.phase, self.request = Phase.OPENING, message
            return OpenRequested(message)
        if self.phase is not Phase.OPEN or not isinstance(message, Step | CloseSession):
            raise _out_of_turn("the server", message, self.phase, "Step or CloseSession")
        self._check_session(message.session_id)
        if isinstance(message, CloseSession):
            self.phase = Phase.CLOSED
            return CloseRequested()
        return StepRequested(message)

    def opened(self, max_length: int, standing: float = 0.0) -> SessionOpened:
        """The session was admitted with `max_length` tokens (its peer has `standing` here):
        the reply to send."""
        if self.phase is not Phase.OPENING or self.request is None:
            raise OutOfTurn(f"cannot open a session that is {self.phase.value}")
        self.phase, self.max_length = Phase.OPEN, max_length
        return SessionOpened(
            session_id=self.request.session_id, max_length=max_length, standing=standing
        )

    def close(self) -> None:
        """The session ended (refused, failed, closed): it takes nothing more."""
        self.phase = Phase.CLOSED

    def receive_pushed(self, step: Step, sender: str) -> StepRequested:
        """A step another server pushed for this session: taken to wait for its turn."""
        if self.phase is not Phase.OPEN or self.request is None:
            raise PushRefused(f"no open session {step.session_id[:12]} to push into")
        self._check_session(step.session_id)
        upstream, token = self.request.upstream, self.request.push_token
        if upstream is not None and sender != upstream:
            raise PushRefused(
                f"session {step.session_id[:12]} takes pushed steps only from {upstream}, the "
                f"hop before it in its client's route; {sender} is not"
            )
        if token is not None and not same_token(token, step.push_token):
            raise PushRefused(
                f"a step pushed by {sender} into session {step.session_id[:12]} does not carry "
                "the session's push token (push the next_hops entry's push_token)"
            )
        if self.pushed_waiting >= self.max_pushed:
            raise TooManyPushed(
                f"more than {self.max_pushed} pushed steps wait for session "
                f"{step.session_id[:12]}: send a session's next step only after its result (or "
                "a prompt in at most 4 chunks)"
            )
        self.pushed_waiting += 1
        return StepRequested(step, pushed=True)

    def start_step(self, step: Step, *, pushed: bool = False) -> bool:
        """Check a step's id and positions right before it runs (steps run one at a time, in
        this order) and count its tokens as cached. False: a stale pushed step, to drop."""
        if pushed:
            self.pushed_waiting = max(0, self.pushed_waiting - 1)
        if self.phase is not Phase.OPEN:
            raise OutOfTurn(f"a step for a session that is {self.phase.value}")
        if step.step_id <= self.last_step_id:
            if pushed:
                return False
            raise StepOutOfOrder(
                f"step {step.step_id} after step {self.last_step_id}: step ids must increase "
                "within a session"
            )
        self._check_positions(step)
        self.last_step_id = step.step_id
        start = self.position if step.start_position is None else step.start_position
        self.position = start + int(step.hidden_states.shape[1])
        return True

    def _check_positions(self, step: Step) -> None:
        position, tokens = self.position, int(step.hidden_states.shape[1])
        if step.start_position is not None:
            if step.start_position > position:
                raise BadStartPosition(
                    f"start_position {step.start_position} is past the session's {position} "
                    "cached tokens"
                )
            position = step.start_position
        if position + tokens > self.max_length:
            raise BadStartPosition(
                f"this step would bring the session to {position + tokens} tokens, past its "
                f"max_length of {self.max_length}; open a session with a larger max_length"
            )

    def _check_session(self, session_id: str) -> None:
        assert self.request is not None
        if session_id != self.request.session_id:
            raise WrongSession(
                f"a message for session {session_id[:12]} on the stream of session "
                f"{self.request.session_id[:12]}"
            )


def same_token(expected: str, given: str | None) -> bool:
    """Constant-time: how long a comparison takes tells nothing of how much of a guess matched."""
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


# --- inference, client side ---------------------------------------------------------------------


@dataclass(frozen=True)
class Owed:
    """A step whose reply the client waits for: its reply must have `shape` (its input's; None:
    not checked), or, when it asked for `reply_last` positions (Step.reply_last), those last
    positions only, and is used in `dtype`."""

    step_id: int
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    reply_last: int | None = None


@dataclass
class ClientInference:
    """The client's side of one inference session on one server. See the module docstring."""

    request: OpenSession
    phase: Phase = Phase.OPENING
    max_length: int = 0
    last_step_id: int = -1
    owed: list[Owed] = field(default_factory=list)  # the steps whose replies we wait for, in order
    abandoned: set[int] = field(default_factory=set)  # steps whose late replies we drop

    @property
    def session_id(self) -> str:
        return self.request.session_id

    def received(self, message: Message) -> ClientEvent:
        """A message from the server on this session's stream."""
        if self.phase is Phase.CLOSED:
            raise _out_of_turn("the client", message, self.phase, "nothing")
        if isinstance(message, Error):
            self.phase = Phase.CLOSED
            return Refused(message)
        if self.phase is Phase.OPENING:
            if not isinstance(message, SessionOpened):
                raise _out_of_turn("the client", message, self.phase, "SessionOpened or Error")
            self._check_session(message.session_id)
            self.phase, self.max_length = Phase.OPEN, message.max_length
            return Opened(message)
        if not isinstance(message, StepResult):
            raise _out_of_turn("the client", message, self.phase, "StepResult or Error")
        self._check_session(message.session_id)
        return self._step_reply(message)

    def _step_reply(self, result: StepResult) -> StepDone | LateReply | Unsolicited:
        if self.owed and result.step_id == self.owed[0].step_id:
            owed = self.owed.pop(0)
            # A server answers in order: replies to steps before this one will never come.
            self.abandoned = {s for s in self.abandoned if s > result.step_id}
            if owed.shape is not None:
                check_step_output(
                    result.hidden_states, owed.shape, result.step_id, owed.dtype, owed.reply_last
                )
            return StepDone(result)
        if result.step_id in self.abandoned:
            self.abandoned.discard(result.step_id)
            return LateReply(result)
        if any(owed.step_id == result.step_id for owed in self.owed):
            raise UnexpectedReply(
                f"a reply to step {result.step_id} before the reply to step "
                f"{self.owed[0].step_id}, sent before it: a server answers in order"
            )
        if self.request.upstream is not None:
            return Unsolicited(result)
        waiting = self.owed[0].step_id if self.owed else None
        raise UnexpectedReply(
            f"a reply to step {result.step_id}, which this client never sent (waiting for "
            f"{waiting})"
        )

    def sent_step(
        self,
        step_id: int,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        queued: bool = False,
        reply_last: int | None = None,
    ) -> None:
        """A step for this session was sent to its server (or pushed there on our behalf),
        its input of `shape` and `dtype` (None: its reply is not checked), the server to answer
        with its output's last `reply_last` positions (a server that answers with all of them,
        unaware of the field, is right too); any earlier step still unanswered is given up on,
        unless this one is `queued` behind them."""
        if self.phase is not Phase.OPEN:
            raise OutOfTurn(f"cannot step a session that is {self.phase.value}")
        if step_id <= self.last_step_id:
            raise StepOutOfOrder(
                f"step {step_id} after step {self.last_step_id}: step ids must increase within "
                "a session (draw them from one counter, whether a step is sent or pushed)"
            )
        if not queued:
            self.abandoned.update(owed.step_id for owed in self.owed)
            self.owed.clear()
        self.last_step_id = step_id
        self.owed.append(Owed(step_id, shape, dtype, reply_last))

    def cancelled(self, step_id: int) -> None:
        """We stopped waiting for `step_id`'s reply: it is dropped when it comes."""
        if any(owed.step_id == step_id for owed in self.owed):
            self.owed = [owed for owed in self.owed if owed.step_id != step_id]
            self.abandoned.add(step_id)

    def closing(self) -> CloseSession:
        """The message that ends the session; the conversation takes nothing after it."""
        self.phase = Phase.CLOSED
        return CloseSession(session_id=self.session_id)

    def _check_session(self, session_id: str) -> None:
        if session_id != self.session_id:
            raise WrongSession(
                f"a reply for session {session_id[:12]} on the stream of session "
                f"{self.session_id[:12]}"
            )


def check_step_output(
    hidden: torch.Tensor,
    shape: tuple[int, ...],
    step_id: int,
    dtype: torch.dtype | None = None,
    reply_last: int | None = None,
) -> None:
    """BadReply unless `hidden` (a reply to step `step_id`) has `shape`, its input's (or, with
    `reply_last`, that of its last positions), and only finite values, also once in `dtype` (the
    input's: a float64 1e300 is inf in float32). The schema already holds it to 3 floating
    dimensions."""
    shapes = [tuple(shape)]
    if reply_last is not None and len(shape) == 3 and reply_last < shape[1]:
        shapes.append((shape[0], reply_last, shape[2]))
    if tuple(hidden.shape) not in shapes:
        asked = f" or its last {reply_last} positions" if len(shapes) > 1 else ""
        raise BadReply(
            f"the reply to step {step_id} has hidden states of shape {list(hidden.shape)}; the "
            f"step's input was {list(shape)} and a span's output has its input's shape{asked}"
        )
    if dtype is not None and hidden.dtype != dtype:
        hidden = hidden.to(dtype)
    if not all_finite(hidden):
        raise BadReply(f"the reply to step {step_id} has hidden states that are not finite")
