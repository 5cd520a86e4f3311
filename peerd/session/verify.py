"""Spot checks of servers' results: a client re-runs some steps on a second server holding the
same blocks and compares, so a server that returns wrong hidden states is caught and banned.

Which steps: the first step of every hop (a new server's first answer, usually the prompt, is
checked before any token depends on it) and then each later step with probability
`fraction`. How: the verifier keeps a *shadow session* per checked span on another server (never
the checked one, never our own), and feeds it, in one step, every input the span received since
the shadow's last check, ending with this step's; the shadow then holds the same cache the
checked server should hold, and its output for this step's tokens must equal the claimed one
within `tolerance()`. The inputs are the client's own record of what it sent into that block
(the route keeper keeps them for failover), so no server can choose what the check sees.

A mismatch alone does not say who lied, so a *referee* (a third server holding the span, in a
fresh session fed the whole history) decides: the side it agrees with is honest and the other
is banned for LIAR_BAN_S, with the evidence logged (blocks, positions, max abs diff, tolerance,
peers). With no referee available, or a referee agreeing with neither, both are banned: a swarm
that cannot tell is not trusted. Our own server is trusted and never checked.

The step runner (peerd.session.steps) calls SpotChecks after every step: a hop caught lying is
replaced and the step re-run from it, so the caller only ever sees honest outputs.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

import wire
from peerd.session.hops import PEER_FAULTS, HopSession, WrongResult
from peerd.session.route import RouteKeeper
from peerd.session.swarm import SwarmView
from routing.planner import RouteHop
from routing.records import ROUTABLE_STATES, ServerRecord
from wire.peer_protocol import CompressionName

log = logging.getLogger(__name__)

# Relative to each token's largest |value|: fp32 recomputation differs by summation order
# (a prefill of many tokens against decode steps of one): at most 2.3e-6 measured on the default
# model's blocks 0:10, 0:30 and 20:30. ~100x that is still far below any corruption that could
# change a token.
RELATIVE_TOLERANCE = 2e-4
ABSOLUTE_TOLERANCE = 1e-4


class CheckedHop(Protocol):
    """What the verifier needs of a hop (HopSession and LocalHopSession both qualify)."""

    hop: RouteHop

    @property
    def peer_id(self) -> str: ...

    async def step(
        self, hidden: torch.Tensor, codec: CompressionName, start_position: int | None = None
    ) -> torch.Tensor: ...

    async def close(self) -> None: ...


OpenHop = Callable[[RouteHop], Awaitable[CheckedHop]]


@dataclass(frozen=True)
class Mismatch:
    """Evidence of one wrong result: who, where, by how much, who said so."""

    liar: str
    start: int
    end: int
    positions: tuple[int, int]
    max_abs_diff: float
    tolerance: float
    verifier: str
    referee: str | None
    at: float = field(default_factory=time.time)

    def describe(self) -> str:
        referee = f", referee {self.referee}" if self.referee else ", no referee"
        return (
            f"{self.liar} returned wrong hidden states for blocks {self.start}:{self.end} at "
            f"positions {self.positions[0]}:{self.positions[1]} (max abs diff "
            f"{self.max_abs_diff:.4g}, tolerance {self.tolerance:.4g}; verifier "
            f"{self.verifier}{referee})"
        )


def tolerance(expected: torch.Tensor, codec: CompressionName) -> torch.Tensor:
    """Per token [batch, tokens]: how far an honest result may be from `expected`. Both results
    crossed the wire in `codec`, so each may carry its rounding once."""
    codec_error = wire.round_trip_error(expected, codec)
    scale = expected.abs().amax(dim=-1)
    return 2 * codec_error + RELATIVE_TOLERANCE * scale + ABSOLUTE_TOLERANCE


def excess(expected: torch.Tensor, claimed: torch.Tensor, codec: CompressionName) -> float:
    """How far `claimed` is past the tolerance around `expected` (<= 0: they agree)."""
    diff = (expected.float() - claimed.float()).abs().amax(dim=-1)
    return float((diff - tolerance(expected, codec)).max())


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@dataclass
class _Shadow:
    session: CheckedHop
    position: int = 0  # tokens of the span's input history it has cached


class StepVerifier:
    """Spot checks for one InferenceSession (SpotChecks calls `check` after every step)."""

    def __init__(
        self,
        swarm: SwarmView,
        fraction: float,
        open_hop: OpenHop,
        *,
        codec: CompressionName,
        session_tokens: int,
        adapter: str | None = None,
        allowed: frozenset[str] | None = None,
        blocked: frozenset[str] = frozenset(),
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"verify fraction must be in [0, 1], got {fraction}")
        self.swarm = swarm
        self.fraction = fraction
        self.open_hop = open_hop
        self.codec = codec
        self.session_tokens = session_tokens
        self.adapter = adapter  # the session's LoRA adapter: checkers must have it too
        self.allowed, self.blocked = allowed, blocked  # the session's routing limits hold too
        self.rng = rng or random.Random()
        self._shadows: dict[tuple[int, int], _Shadow] = {}
        self._checked_hops: set[int] = set()  # id() of hops whose first step was checked
        self.checks = 0
        self.mismatches: list[Mismatch] = []

    def wants(self, hop: CheckedHop) -> bool:
        """Whether to check this hop's step now (its first step always, then at random)."""
        if hop.peer_id == self._own_id():
            return False
        if id(hop) not in self._checked_hops:
            self._checked_hops.add(id(hop))
            return True
        return self.rng.random() < self.fraction

    async def check(
        self,
        hop: CheckedHop,
        history: torch.Tensor,
        claimed: torch.Tensor,
    ) -> str | None:
        """Check `hop`'s `claimed` output for the last claimed.shape[1] tokens of `history` (every
        input its span got, this step's last). Returns the peer found lying, or None."""
        start, end = hop.hop.start, hop.hop.end
        first = history.shape[1] - claimed.shape[1]
        shadow = await self._shadow(start, end, exclude={hop.peer_id})
        if shadow is None:
            log.debug("no second server holds blocks %d:%d: step not checked", start, end)
            return None
        verifier = shadow.session.peer_id
        from_position = min(shadow.position, first)
        try:
            output = await shadow.session.step(
                history[:, from_position:], self.codec, from_position
            )
        except PEER_FAULTS as e:
            log.info("verifier %s failed (%s): step not checked", verifier, e)
            await self._drop(start, end)
            return None
        shadow.position = history.shape[1]
        self.checks += 1
        expected = output[:, -claimed.shape[1] :]
        if excess(expected, claimed, self.codec) <= 0:
            return None
        return await self._judge(hop, history, claimed, expected, verifier)

    async def _judge(
        self,
        hop: CheckedHop,
        history: torch.Tensor,
        claimed: torch.Tensor,
        verified: torch.Tensor,
        verifier: str,
    ) -> str | None:
        """The checked server and the verifier disagree: a referee decides who lied."""
        start, end = hop.hop.start, hop.hop.end
        referee_output, referee = await self._referee(
            start, end, history, exclude={hop.peer_id, verifier}
        )
        tokens = claimed.shape[1]
        if referee_output is None:
            liars = [hop.peer_id, verifier]
        else:
            # It ran the whole history: its claimed positions only.
            referee_output = referee_output[:, -tokens:]
            honest_claim = excess(referee_output, claimed, self.codec) <= 0
            honest_verifier = excess(referee_output, verified, self.codec) <= 0
            liars = [
                peer
                for peer, honest in ((hop.peer_id, honest_claim), (verifier, honest_verifier))
                if not honest
            ]
        outputs = {hop.peer_id: claimed, verifier: verified}
        for liar in liars:
            other = verified if liar == hop.peer_id else claimed
            reference = other if referee_output is None else referee_output
            suspect = outputs[liar]
            evidence = Mismatch(
                liar=liar,
                start=start,
                end=end,
                positions=(history.shape[1] - tokens, history.shape[1]),
                max_abs_diff=max_diff(reference, suspect),
                tolerance=float(tolerance(reference, self.codec).max()),
                verifier=verifier,
                referee=referee,
            )
            self.mismatches.append(evidence)
            log.warning("verification: %s; banning it", evidence.describe())
            self.swarm.report_lie(liar)
        if verifier in liars:
            await self._drop(start, end)
        return hop.peer_id if hop.peer_id in liars else None

    async def _referee(
        self, start: int, end: int, history: torch.Tensor, exclude: set[str]
    ) -> tuple[torch.Tensor | None, str | None]:
        """A third server's output for history's tokens, in a fresh session (None if none)."""
        record = self._pick(start, end, exclude)
        if record is None:
            return None, None
        try:
            session = await self.open_hop(RouteHop(record.peer_id, start, end, record))
        except PEER_FAULTS as e:
            log.info("referee %s could not open a session: %s", record.peer_id, e)
            return None, None
        try:
            output = await session.step(history, self.codec, 0)
        except PEER_FAULTS as e:
            log.info("referee %s failed: %s", record.peer_id, e)
            return None, None
        finally:
            await session.close()
        return output, record.peer_id

    async def _shadow(self, start: int, end: int, exclude: set[str]) -> _Shadow | None:
        shadow = self._shadows.get((start, end))
        if shadow is not None and (
            shadow.session.peer_id in exclude
            or self.swarm.bans.is_banned(shadow.session.peer_id, time.time())
        ):
            await self._drop(start, end)
            shadow = None
        if shadow is None:
            record = self._pick(start, end, exclude)
            if record is None:
                return None
            try:
                session = await self.open_hop(RouteHop(record.peer_id, start, end, record))
            except PEER_FAULTS as e:  # no verifier this time; the step goes unchecked
                log.info("verifier %s could not open a session: %s", record.peer_id, e)
                return None
            shadow = self._shadows[(start, end)] = _Shadow(session)
        return shadow

    def _pick(self, start: int, end: int, exclude: set[str]) -> ServerRecord | None:
        """A random online, unbanned server other than `exclude` and us that holds all of
        [start, end) and has room for the session (random: a liar cannot predict it)."""
        now = time.time()
        own = self._own_id()
        candidates = [
            r
            for r in self.swarm.snapshot().records
            if r.start <= start
            and end <= r.end
            and r.state in ROUTABLE_STATES
            and r.peer_id not in exclude
            and r.peer_id != own
            and not self.swarm.bans.is_banned(r.peer_id, now)
            and r.free_cache_tokens >= self.session_tokens
            and (self.adapter is None or self.adapter in r.adapters)
            and (self.allowed is None or r.peer_id in self.allowed)
            and r.peer_id not in self.blocked
        ]
        return self.rng.choice(sorted(candidates, key=lambda r: r.peer_id)) if candidates else None

    def _own_id(self) -> str | None:
        local = self.swarm.local_server
        return local.peer_id if local is not None else None

    async def _drop(self, start: int, end: int) -> None:
        shadow = self._shadows.pop((start, end), None)
        if shadow is not None:
            await shadow.session.close()

    async def close(self) -> None:
        for key in list(self._shadows):
            await self._drop(*key)


Relay = Callable[[int, torch.Tensor, int | None], Awaitable[torch.Tensor]]


class SpotChecks:
    """The step runner's hook: spot-check the hops of each step (StepVerifier.wants says
    which). A hop caught lying is replaced and the step re-runs from it on honest servers
    through `relay` (the later hops roll their caches back to the step's first position), so
    the output returned is the honest one."""

    def __init__(self, verifier: StepVerifier, route: RouteKeeper, relay: Relay) -> None:
        self.verifier = verifier
        self.route = route
        self.relay = relay

    async def __call__(
        self, output: torch.Tensor, first_position: int, end_position: int
    ) -> torch.Tensor:
        hops, inputs = self.route.hops, self.route.inputs  # replace() edits both in place
        i = 0
        while i < len(hops):
            hop = hops[i]
            if not isinstance(hop, HopSession) or not self.verifier.wants(hop):
                i += 1
                continue
            start = hop.hop.start
            history = inputs[start][:, :end_position]
            if i + 1 < len(hops):
                claimed = inputs[hops[i + 1].hop.start][:, first_position:end_position]
            else:
                claimed = output
            liar = await self.verifier.check(hop, history, claimed)
            if liar is None:
                i += 1
                continue
            step_input = history[:, first_position:]
            self.route.forget(start, first_position)
            await self.route.replace(i, WrongResult(f"{liar} failed a spot check"))
            output = await self.relay(i, step_input, first_position)
        return output
