"""The training conversation as sans-IO state machines (see wire.conversation for the inference
one): Forward -> ForwardResult, Backward -> BackwardResult, Error for either; one request at a
time on a stream."""

from __future__ import annotations

from dataclasses import dataclass

from wire.conversation import OutOfTurn, Refused, UnexpectedReply
from wire.peer_protocol import Backward, BackwardResult, Error, Forward, ForwardResult
from wire.schema import Message


@dataclass(frozen=True)
class TrainingRequested:
    request: Forward | Backward


@dataclass(frozen=True)
class TrainingDone:
    result: ForwardResult | BackwardResult


@dataclass
class ServerTraining:
    """The server's side of a training stream: Forward and Backward requests, each answered in
    turn. A message of another kind breaks this rule alone: answer the Error, read on."""

    requests: int = 0

    def receive(self, message: Message) -> TrainingRequested:
        if not isinstance(message, Forward | Backward):
            raise OutOfTurn(
                "expected Forward or Backward on the training protocol, got "
                f"{type(message).__name__}"
            )
        self.requests += 1
        return TrainingRequested(message)


@dataclass
class ClientTraining:
    """The client's side of a training stream: one request at a time, its reply of the kind
    asked (ForwardResult for Forward, BackwardResult for Backward) or an Error."""

    pending: Forward | Backward | None = None

    def sent(self, request: Forward | Backward) -> None:
        if self.pending is not None:
            raise OutOfTurn(
                f"a {type(request).__name__} sent while a {type(self.pending).__name__} waits "
                "for its reply"
            )
        self.pending = request

    def received(self, message: Message) -> TrainingDone | Refused:
        pending, self.pending = self.pending, None
        if pending is None:
            raise UnexpectedReply(f"a {type(message).__name__} with no request waiting")
        if isinstance(message, Error):
            return Refused(message)
        wanted = ForwardResult if isinstance(pending, Forward) else BackwardResult
        if not isinstance(message, wanted):
            raise UnexpectedReply(
                f"a {type(pending).__name__} answered with {type(message).__name__}"
            )
        return TrainingDone(message)
