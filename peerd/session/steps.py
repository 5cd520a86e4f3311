"""Step running for one inference session: push a step down the chain of hops (each server
forwards its output to the next and answers us too) or relay it hop by hop ourselves, collecting
every hop's output, then hand the step's output to the hooks (spot checks) that may change it.

A hop that fails mid-step is handed to the route keeper to replace, and the step goes on from
that hop on the replacement. Every reply is held to its step's input shape and to finite values
(wire.conversation.ClientInference) before it is used. A hop that a push reached ran on what
the server before it sent, which we never saw: when it fails in a way that bad input could
cause (an error reply, a wrong reply, silence), it is not blamed (hops.Unattributed); only a
hop that fails on a step we sent it ourselves is.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import torch

import wire
from peerd.node.streams import Idle
from peerd.session.hops import (
    PEER_FAULTS,
    FirstStep,
    HopSession,
    LeaseLapsed,
    StepRefused,
    Unattributed,
)
from peerd.session.route import RouteKeeper
from routing.planner import RouteHop
from wire.peer_protocol import CompressionName

# Called after each step with (the step's output, the position of its first token); returns the
# output to use (a spot check that caught a liar re-runs the step and returns the honest one).
StepHook = Callable[[torch.Tensor, int], Awaitable[torch.Tensor]]


class StepRunner:
    """Runs steps through the hops a RouteKeeper holds."""

    def __init__(self, route: RouteKeeper, codec: CompressionName, push: bool) -> None:
        self.route = route
        self.codec = codec
        self.push = push
        self.hooks: list[StepHook] = []
        # The group of the client's concurrent sessions the next steps belong to
        # (wire.Step.micro_batch; set by the generation that runs them); None: merged with any.
        self.micro_batch: int | None = None

    async def run(
        self, hidden: torch.Tensor, first_position: int, rewind: int | None
    ) -> torch.Tensor:
        """Run [batch, tokens, hidden] starting at `first_position` through every hop; with
        `rewind`, every hop is told where the tokens start (rolling back what it holds past
        it)."""
        i = 0
        pushing = self.push and self.route.pushing
        if self.route.deferred:  # the session's first step opens its route
            first = None
            if pushing and rewind is None:
                first = FirstStep(hidden, next(self.route.step_ids), self.micro_batch)
            await self.route.open_with(first)
            if first is not None and first.sent:  # every hop is remote then
                carried = [hop for hop in self.route.hops if isinstance(hop, HopSession)]
                i, hidden = await self._collect(carried, first.step_id, hidden, None)
                if i < len(self.route.hops):
                    rewind = first_position  # (as below)
                pushing = False  # done: relay from the break, if it broke
        hops = self.route.hops
        remote = all(isinstance(hop, HopSession) for hop in hops)
        if pushing and remote and len(hops) > 1:
            # A rewind rides the push: every server passes the start position on with its
            # output, so a rollback (speculative decoding's rejected drafts) costs no round trip.
            i, hidden = await self._push_step(hidden, rewind)
            if i < len(hops):
                # The chain broke. A server past the break may still have got the push (its
                # pusher died after sending): starting the relayed step at our position rolls
                # such a cache back instead of appending the tokens twice.
                rewind = first_position
        hidden = await self.relay(i, hidden, rewind)
        for hook in self.hooks:
            hidden = await hook(hidden, first_position)
        return hidden

    async def relay(self, i: int, hidden: torch.Tensor, rewind: int | None) -> torch.Tensor:
        """Client-relayed: each hop from `i` on in turn (all of them without push, or from
        where a push chain broke); returns the last hop's output."""
        hops = self.route.hops
        while i < len(hops):
            hop = hops[i]
            sent = time.perf_counter()
            try:
                output = await hop.step(hidden, self.codec, rewind, self.micro_batch)
            except PEER_FAULTS as e:
                await self.route.replace(i, e)
                continue  # the replacement hops start at the same block: retry with `hidden`
            self.route.remember(hop.hop.start, hidden)
            self.route.swarm.report_success(hop.peer_id)
            _record_step(self.route, hop.hop, hidden, sent)
            hidden = output
            i += 1
        return hidden

    async def _push_step(
        self, hidden: torch.Tensor, rewind: int | None = None
    ) -> tuple[int, torch.Tensor]:
        """Send the step to the first hop naming the rest: each server pushes its output to
        the next and also answers us, so a step costs one pass through the chain and we still
        hold every hop's input for failover. Returns (first hop not done, its input).

        The chain ends before a hop that takes pushes from another peer than the hop before it
        (it named a server since replaced): that hop would drop the push, so we relay to it."""
        hops = [hop for hop in self.route.hops if isinstance(hop, HopSession)]
        reach = next(
            (k for k in range(1, len(hops)) if hops[k].upstream != hops[k - 1].peer_id),
            len(hops),
        )
        hops = hops[:reach]
        step_id = next(self.route.step_ids)
        chain = tuple(hop.as_next_hop() for hop in hops[1:])
        sent = time.perf_counter()
        try:
            await hops[0].send_step(
                hidden, self.codec, step_id, rewind, next_hops=chain, micro_batch=self.micro_batch
            )
        except PEER_FAULTS:
            return 0, hidden  # the relay loop retries hop 0 and replaces it if it is gone
        return await self._collect(hops, step_id, hidden, sent)

    async def _collect(
        self, hops: Sequence[HopSession], step_id: int, hidden: torch.Tensor, sent: float | None
    ) -> tuple[int, torch.Tensor]:
        """Every hop's reply to step `step_id`, sent to the first of `hops` (at `sent`; None:
        with its OpenSession, so not timed) and pushed through the rest: (first hop not done,
        its input)."""
        for hop in hops[1:]:
            # Their replies to the pushed step come on their streams, shaped as its input.
            hop.expect(step_id, hidden)
        for i, hop in enumerate(hops):
            try:
                result = await hop.receive_result(step_id)
            except PEER_FAULTS as e:
                await self.route.replace(i, _pushed_fault(e) if i > 0 else e)
                return i, hidden
            self.route.remember(hop.hop.start, hidden)
            self.route.swarm.report_success(hop.peer_id)
            if i == 0 and sent is not None:  # a later hop's input comes by push: not timed
                _record_step(self.route, hop.hop, hidden, sent)
            hidden = result.hidden_states.to(hidden.dtype)  # ours, whatever the server sent
            if result.push_failed and i + 1 < len(hops):
                return i + 1, hidden
        return len(hops), hidden


def _pushed_fault(error: Exception) -> Exception:
    """A fault of a hop that got the step pushed by the server before it: one that input from
    that server could cause is Unattributed (a refusal of the step, a reply that breaks the
    conversation or is wrong, silence: the push may never have come); the stream's end or
    bytes that are no message are the hop's own."""
    if isinstance(error, LeaseLapsed):  # the server's own doing, and no fault
        return error
    if isinstance(error, Unattributed | StepRefused | Idle | wire.ConversationError):
        if isinstance(error, Unattributed):
            return error
        unattributed = Unattributed(f"{error} (on a step pushed to it)")
        unattributed.__cause__ = error
        return unattributed
    return error


def _record_step(route: RouteKeeper, hop: RouteHop, hidden: torch.Tensor, sent: float) -> None:
    """Tell the swarm view how long `hop`'s server took over a step of `hidden` sent at `sent`
    (routing believes announced throughputs only as far as such timings allow)."""
    tokens = int(hidden.shape[0]) * int(hidden.shape[1])
    route.swarm.record_step(hop.peer_id, hop.end - hop.start, tokens, time.perf_counter() - sent)
