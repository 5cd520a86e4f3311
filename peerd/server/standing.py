"""Standing: what each peer that sends this server work contributes to the same model, as this
server sees it, measured rather than claimed.

A peer is known by the peer id its Noise handshake authenticated, the one its session streams
come from (a daemon opens its sessions from the same libp2p host that serves its blocks, so a
volunteer's generations carry its standing). What counts, per peer:

- it serves blocks of our model now: its record is in our swarm view (confirmed by an `info` call
  at the view's last refresh, state online), not missed at that refresh, and not banned;
- how many blocks, as a share of the model;
- how fast, as measured by use: the speed per block this daemon timed on its own steps through it
  (routing.speeds, believed up to twice the measurement), or for a server never timed at most the
  swarm's median speed per block, whatever it announces;
- for how long: a stretch of serving counts once it has lasted `qualify_s`, and weighs more the
  longer it lasts, up to `tenure_s`.

A claim that a call contradicts earns nothing: a peer our sessions saw fail a call or caught
answering wrong (spot checks, peerd.session.verify) loses its standing at once, and starts over
(qualifying again) only after `contradiction_s`. A peer that stops serving (it leaves, its record
expires, it goes unreachable) keeps a standing that falls linearly to zero over `decay_s` from the
last time it was seen serving. Standing is a number in [0, 2]: the share of the model's blocks a
peer serves, times its speed relative to the swarm's median (at most 2), times its tenure weight
(0.5 just qualified .. 1 after tenure_s), times the decay.

Pure: every method takes `now` (seconds on the clock given to the constructor, time.monotonic by
default), so tests move time by hand.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from routing.records import ROUTABLE_STATES, ServerRecord
from routing.speeds import MEASURED_SLACK, block_speed

# A stretch of serving counts once it has lasted this long: at least two refreshes of a swarm view
# (peerd start --refresh-period, 60 s by default; local swarms use a few seconds), so one record
# announced and withdrawn between two looks earns nothing.
QUALIFY_S = 30.0
# Standing grows with the time served, from half at qualifying to all of it after this long.
TENURE_S = 3600.0
# After a peer was last seen serving, its standing falls linearly to zero over this long. The
# whole delay until a peer that stopped serving loses its priority is the time our view takes to
# notice (its next refresh, whose info call to the peer fails or finds it gone, at most one
# refresh period; at once when it says it leaves or a call to it fails), plus our next look at
# the view (peerd.daemon.contributions.STANDING_LOOK_S), plus this.
DECAY_S = 120.0
# A peer that failed a call or answered wrong earns nothing for this long, however it looks.
CONTRADICTION_S = 600.0
# Relative speed per block is capped: a fast server counts at most twice a median one.
MAX_SPEED_FACTOR = 2.0
TENURE_FLOOR = 0.5


@dataclass
class _Serving:
    """One peer's current (or last) stretch of serving."""

    blocks: int  # of our model
    speed: float  # relative to the swarm median per block, 0..MAX_SPEED_FACTOR
    since: float  # when the stretch began
    last: float  # when it was last seen serving


class Standing:
    """Per peer id, the standing this server grants it (module docstring)."""

    def __init__(
        self,
        *,
        num_blocks: int = 0,
        qualify_s: float = QUALIFY_S,
        tenure_s: float = TENURE_S,
        decay_s: float = DECAY_S,
        contradiction_s: float = CONTRADICTION_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(qualify_s, contradiction_s) < 0 or min(tenure_s, decay_s) <= 0:
            raise ValueError("standing periods must be >= 0 (tenure and decay > 0)")
        self.num_blocks = num_blocks
        self.qualify_s = qualify_s
        self.tenure_s = tenure_s
        self.decay_s = decay_s
        self.contradiction_s = contradiction_s
        self.clock = clock
        self._serving: dict[str, _Serving] = {}
        self._contradicted: dict[str, float] = {}  # peer -> until when it earns nothing

    def saw_serving(self, peer: str, blocks: int, speed: float, now: float | None = None) -> None:
        """`peer` serves `blocks` of our model now, at `speed` (relative to the swarm's median
        per block): its stretch goes on, or begins."""
        now = self.clock() if now is None else now
        if self._contradicted.get(peer, -math.inf) > now or blocks <= 0:
            return
        speed = min(max(speed, 0.0), MAX_SPEED_FACTOR) if math.isfinite(speed) else 0.0
        seen = self._serving.get(peer)
        if seen is None or now - seen.last >= self.decay_s:  # gone too long: a new stretch
            self._serving[peer] = _Serving(blocks, speed, since=now, last=now)
        else:
            seen.blocks, seen.speed, seen.last = blocks, speed, now

    def contradicted(self, peer: str, now: float | None = None) -> None:
        """A call to `peer` failed or it answered wrong: its claim earns nothing, now and for
        contradiction_s; then it starts over."""
        now = self.clock() if now is None else now
        self._serving.pop(peer, None)
        self._contradicted[peer] = now + self.contradiction_s

    def of(self, peer: str, now: float | None = None) -> float:
        """The peer's standing now (0: it contributes nothing we can see)."""
        now = self.clock() if now is None else now
        seen = self._serving.get(peer)
        if seen is None or not self.num_blocks or self._contradicted.get(peer, -math.inf) > now:
            return 0.0
        stretch = seen.last - seen.since
        if stretch < self.qualify_s:
            return 0.0
        decay = 1.0 - max(0.0, now - seen.last) / self.decay_s
        if decay <= 0:
            return 0.0
        tenure = TENURE_FLOOR + (1 - TENURE_FLOOR) * min(1.0, stretch / self.tenure_s)
        share = min(1.0, seen.blocks / self.num_blocks)
        return share * seen.speed * tenure * decay

    def standings(self, now: float | None = None) -> dict[str, float]:
        """Every peer with a standing above zero; forgets the ones that decayed away."""
        now = self.clock() if now is None else now
        for peer, seen in list(self._serving.items()):
            if now - seen.last > self.decay_s:
                del self._serving[peer]
        for peer, until in list(self._contradicted.items()):
            if until <= now:
                del self._contradicted[peer]
        out = {peer: self.of(peer, now) for peer in self._serving}
        return {peer: value for peer, value in out.items() if value > 0}

    def observe_swarm(
        self,
        records: Iterable[ServerRecord],
        *,
        model: str,
        num_blocks: int,
        measured: Mapping[str, float],
        contradicted: Iterable[str] = (),
        unreachable: Iterable[str] = (),
        now: float | None = None,
    ) -> None:
        """One look at a swarm view: `records` (live, confirmed at its last refresh), `measured`
        (seconds per token per block our own steps took, routing.speeds.StepSpeeds),
        `contradicted` (peers that failed a call or lied: banned), `unreachable` (peers whose
        info call failed at the last refresh)."""
        now = self.clock() if now is None else now
        self.num_blocks = num_blocks
        for peer in contradicted:
            self.contradicted(peer, now)
        missed = set(unreachable)
        live = [
            r
            for r in records
            if r.model == model and r.state in ROUTABLE_STATES and r.peer_id not in missed
        ]
        speeds = relative_speeds(live, measured)
        for record in live:
            self.saw_serving(record.peer_id, record.num_blocks, speeds[record.peer_id], now)


def relative_speeds(records: list[ServerRecord], measured: Mapping[str, float]) -> dict[str, float]:
    """Per record, its speed per block relative to the lower median of the announced ones: what
    we measured (believed up to MEASURED_SLACK times the measurement, never above what it
    announces), or for a server we never timed the announced speed capped at the median."""
    announced = sorted(block_speed(r) for r in records if r.throughput > 0)
    if not announced:
        return {r.peer_id: 0.0 for r in records}
    median = announced[(len(announced) - 1) // 2]
    out: dict[str, float] = {}
    for r in records:
        own = block_speed(r)
        seconds = measured.get(r.peer_id)
        if seconds is not None and math.isfinite(seconds) and seconds > 0:
            speed = min(own, MEASURED_SLACK / seconds)
        else:
            speed = min(own, median)
        out[r.peer_id] = min(speed / median, MAX_SPEED_FACTOR) if median > 0 else 0.0
    return out
