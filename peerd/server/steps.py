"""What the batcher (peerd.server.batching) keeps of the steps it runs and of the sessions that
sent them, and what it counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blocks import Span, SpanSession


@dataclass
class Recent:
    """What the batcher remembers of a session that stepped lately."""

    session: SpanSession
    owner: str  # the peer whose session it is
    at: float  # when its last step came
    period: float = 0.0  # smoothed time between its steps (0: one step so far)
    cohort: int = 0  # the merged round that ran its last step (0: it ran alone)


@dataclass(eq=False)
class Step:
    """One inference step, from its arrival at the batcher to its result."""

    span: Span
    session: SpanSession
    hidden: torch.Tensor
    owner: str  # the peer that sent it: turns are fair between peers first
    order: int
    start_position: int  # where the session stood, to undo a long step that fails half-way
    adapter: str | None  # the LoRA adapter it runs with: only steps of one adapter merge
    micro_batch: int | None = None  # its owner's group (wire.Step.micro_batch; None: any)
    done: int = 0  # tokens already run (a long step goes chunk by chunk)
    outputs: list[torch.Tensor] = field(default_factory=list)
    error: BaseException | None = None
    finished: bool = False
    abandoned: bool = False  # its caller went away (cancelled)
    shared: bool = False  # other peers stepped lately: a long step runs in short turns
    turn_tokens: int = 0  # tokens its current turn runs (a long step: one piece of it)
    in_lane: bool = False  # its turn runs in the takers' lane now (under the batcher's _lock)
    forward_s: float = 0.0  # time in the forwards (rounds) that ran it

    @property
    def left(self) -> int:
        return int(self.hidden.shape[1]) - self.done

    def joins(self, head: Step) -> bool:
        """It may run in the forward `head` leads: the same span and adapter, and not one of its
        owner's other micro-batches (wire.Step.micro_batch: one takes the servers while the
        other is on another hop)."""
        groups = (self.micro_batch, head.micro_batch)
        apart = self.owner == head.owner and None not in groups and groups[0] != groups[1]
        return self.span is head.span and self.adapter == head.adapter and not apart

    @property
    def remaining(self) -> torch.Tensor:
        return self.hidden[:, self.done :]

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])

    def undo(self) -> None:
        """Forget the chunks of a long step that will not finish (failed or abandoned)."""
        if self.done and not self.session.closed:
            self.session.rollback(self.start_position)

    def finish(self, output: torch.Tensor | None, error: BaseException | None = None) -> None:
        if output is not None:
            self.outputs.append(output)
            self.done += output.shape[1]
        if error is not None:
            self.error, self.finished = error, True
        elif self.left == 0:
            self.finished = True


@dataclass
class BatchCounters:
    forwards: int = 0  # forwards run (a merged one counts once)
    steps: int = 0  # steps finished
    merged_steps: int = 0  # steps that ran in a forward with others


@dataclass
class StepTimes:
    """Where the finished steps of one class (contributor or taker) spent their time here:
    `forward_s` in the rounds that ran them, `wait_s` the rest of the time from their arrival at
    the batcher to their result (waiting for a turn, for partners, for a takers' rest to end)."""

    steps: int = 0
    wait_s: float = 0.0
    forward_s: float = 0.0

    def add(self, served_s: float, forward_s: float) -> None:
        self.steps += 1
        self.forward_s += forward_s
        self.wait_s += max(0.0, served_s - forward_s)
