"""Client side of distributed inference: one session over a chain of servers that survives the
death of any of them.

Each hop is an inference session on one server holding a KV cache for blocks [start, end)
(peerd.session.hops). Two parts do the work: the route keeper (peerd.session.route) opens the
hops, remembers every input sent into each block boundary and, when a hop fails, bans the
server, plans a replacement for the failed blocks and replays the remembered inputs to rebuild
its cache; the step runner (peerd.session.steps) pushes or relays each step through the hops and
calls the spot checks (peerd.session.verify) as a hook. The caller sees a slower step, never an
error, as long as some server holds each block.

A batch of one prompt is a batch like any other: [batch, tokens, hidden] in, the same out.
"""

from __future__ import annotations

import dataclasses

import torch
import trio

import wire
from blocks import check_left_padding
from peerd.session.hops import (
    ADMISSION_WAIT_S,
    OPEN_TIMEOUT_S,
    STEP_TIMEOUT_S,
    Hop,
    HopOptions,
    HopRefused,
    HopSession,
    LocalHopSession,
    WrongResult,
)
from peerd.session.route import (
    INFO_GRACE_S,
    MAX_HOP_FAILURES,
    ROUTE_WAIT_S,
    AdapterUnavailable,
    InferenceFailed,
    RouteKeeper,
)
from peerd.session.steps import StepRunner
from peerd.session.swarm import SwarmView
from peerd.session.verify import SpotChecks, StepVerifier
from routing.planner import RouteHop, format_route
from wire.peer_protocol import CompressionName

__all__ = [
    "ADMISSION_WAIT_S",
    "INFO_GRACE_S",
    "MAX_HOP_FAILURES",
    "OPEN_TIMEOUT_S",
    "ROUTE_WAIT_S",
    "STEP_TIMEOUT_S",
    "AdapterUnavailable",
    "Hop",
    "HopRefused",
    "HopSession",
    "InferenceFailed",
    "InferenceSession",
    "LocalHopSession",
    "WrongResult",
]


class InferenceSession:
    """Hidden states in, hidden states out, through every block of the model, with KV caches kept
    on the servers between steps. Use as `async with InferenceSession(...) as session:`."""

    def __init__(
        self,
        swarm: SwarmView,
        *,
        max_length: int,
        batch_size: int = 1,
        codec: CompressionName = "raw",
        push: bool = True,
        adapter: str | None = None,
        routing: wire.RouteOptions | None = None,
        verify_fraction: float | None = None,
        left_padding: tuple[int, ...] = (),
        open_with_first_step: bool = False,
        pipeline: bool | None = None,
    ) -> None:
        """`routing`: which servers the session may use, how many failed ones it may replace,
        and how long dialing a hop and each step may take (None: the defaults above).
        `left_padding`: per row, padding positions at its start (a batch of prompts).
        `open_with_first_step`: entering only plans a route; the first step opens it, sent to
        the first hop with its OpenSession while the other hops open (hops.FirstStep), one
        round trip sooner; `hops` stays empty until then.
        `pipeline`: a long prompt in chunks (None: the swarm view's pipeline_prompts)."""
        if left_padding:  # ValueError: one count per row, each leaving room for a token
            check_left_padding(left_padding, batch_size, max_length)
        self.swarm = swarm
        self.max_length = max_length
        self.batch_size = batch_size
        self.adapter = adapter  # a LoRA adapter every hop applies (only servers listing it)
        self.position = 0
        # Where the next step's tokens start on every hop, when the servers may hold more
        # (after a rollback, or a step that was cancelled or failed mid-way).
        self._rewind_to: int | None = None
        self.left_padding = tuple(left_padding)
        self.open_with_first_step = open_with_first_step
        options = HopOptions(
            model=swarm.model,
            max_length=max_length,
            batch_size=batch_size,
            codec=codec,
            adapter=adapter,
            left_padding=self.left_padding,
        )
        self.route_keeper = _route_keeper(swarm, options, routing or wire.RouteOptions())
        self.runner = StepRunner(self.route_keeper, codec, push, pipeline)
        # Spot checks of the servers' results (the daemon's --verify unless given here).
        fraction = swarm.verify_fraction if verify_fraction is None else verify_fraction
        self.verifier: StepVerifier | None = None
        if fraction > 0:
            self.verifier = StepVerifier(
                swarm,
                fraction,
                self.route_keeper.open_hop,
                codec=codec,
                session_tokens=batch_size * max_length,
                adapter=adapter,
                allowed=self.route_keeper.allowed,
                blocked=self.route_keeper.blocked,
            )
            hook = SpotChecks(self.verifier, self.route_keeper, self.runner.relay)
            self.runner.hooks.append(hook)

    async def __aenter__(self) -> InferenceSession:
        await self.route_keeper.open(defer=self.open_with_first_step)
        return self

    @property
    def micro_batch(self) -> int | None:
        """The group of this client's concurrent sessions its steps run with on the servers
        (wire.Step.micro_batch): set by a generation before each step; None: with any."""
        return self.runner.micro_batch

    @micro_batch.setter
    def micro_batch(self, group: int | None) -> None:
        self.runner.micro_batch = group

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await self.route_keeper.close()
            if self.verifier is not None:
                await self.verifier.close()

    @property
    def hops(self) -> list[Hop]:
        return self.route_keeper.hops

    @property
    def failures(self) -> int:
        """Servers that failed this session so far (each one replaced)."""
        return self.route_keeper.failures

    @property
    def route(self) -> list[RouteHop]:
        """The route's hops (planned, before the first step opens them)."""
        if self.route_keeper.deferred:
            return list(self.route_keeper.planned)
        return [h.hop for h in self.hops]

    def describe_route(self) -> str:
        return format_route(tuple(self.route))

    async def step(self, hidden: torch.Tensor, keep_last: int | None = None) -> torch.Tensor:
        """Run [batch, tokens, hidden] through all blocks, extending every server's cache.
        `keep_last`: return only the outputs of the last positions (a next token needs one):
        the route's last server sends back no more, which for a long prompt saves the largest
        reply of the step."""
        if hidden.shape[0] != self.batch_size:
            raise ValueError(
                f"this session has batch size {self.batch_size}, got {hidden.shape[0]}"
            )
        if self.position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"this step would reach {self.position + hidden.shape[1]} tokens, past the "
                f"session's max_length of {self.max_length}"
            )
        if keep_last is not None and keep_last < 1:
            raise ValueError(
                f"keep_last must be at least 1 (or None for every position), got {keep_last}"
            )
        tokens = int(hidden.shape[1])
        finished = False
        try:
            hidden = await self.runner.run(hidden, self.position, self._rewind_to, keep_last)
            finished = True
        finally:
            if not finished:
                # Cancelled (Ctrl-C) or failed part-way: some hops may hold this step's tokens.
                # The next step starts every hop at our position; late replies to this one are
                # dropped by step id (wire.conversation.ClientInference).
                self.rollback(self.position)
        self._rewind_to = None
        self.position += tokens
        return hidden

    def rollback(self, position: int) -> None:
        """Forget every token from `position` on: the next step continues from there (the
        servers roll their caches back when it arrives)."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot roll back to {position}: the session holds {self.position}")
        self.position = position
        self._rewind_to = position
        self.route_keeper.truncate(position)


def _route_keeper(swarm: SwarmView, options: HopOptions, routing: wire.RouteOptions) -> RouteKeeper:
    """A route keeper for hops of `options`, within the caller's routing limits and timeouts."""
    allowed = routing.allowed_servers
    options = dataclasses.replace(
        options,
        connect_timeout=routing.connect_timeout or OPEN_TIMEOUT_S,
        request_timeout=routing.request_timeout or STEP_TIMEOUT_S,
    )
    return RouteKeeper(
        swarm,
        options,
        allowed=None if allowed is None else frozenset(allowed),
        blocked=frozenset(routing.blocked_servers),
        max_retries=MAX_HOP_FAILURES if routing.max_retries is None else routing.max_retries,
    )
