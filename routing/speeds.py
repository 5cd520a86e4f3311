"""How fast servers really are: what this client measured of each server's steps, and how much of
each announced throughput routing believes.

A record's throughput is self-reported: a server that announces 1e300 tokens/s would otherwise
take every route through its blocks. Routing therefore plans with a *credible* throughput:

- a server this client has measured is believed up to `MEASURED_SLACK` times what it measured
  (`min(announced, MEASURED_SLACK * measured)`): the slack keeps a jittery measurement from
  costing an honest server its announced figure, and a measurement never raises a figure;
- a server never measured is believed up to `UNMEASURED_OVER_MEDIAN` times the swarm's lower
  median speed per block, so one lying record cannot outrank the whole swarm before its first
  step shows what it is worth (a liar needs half the swarm's records to move that median);
- nothing is believed past `MAX_BLOCK_STEPS_PER_S` steps per block per second, far beyond any
  hardware, so a swarm of liars still yields finite costs.

Speeds are compared per block (throughput * span length): throughput is per whole span, so a
server with a longer span announces less for the same speed per block.

Block selection sums the same credible throughputs (`believed_snapshot`), so a lying record
cannot make its blocks look so well served that every other server moves away from them.

`StepSpeeds` is the measuring side: a `Mapping[peer_id, seconds]` of the smoothed seconds one
token spends in one of a server's blocks, as `plan_route(measured=...)` takes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping

from routing.records import ROUTABLE_STATES, ServerRecord, SwarmSnapshot
from routing.rtt import DEFAULT_ALPHA

# How far above what we measured an announced throughput is still believed. A step's time
# includes queueing behind other sessions and network jitter that the smoothed RTT does not
# remove; twice the measured speed absorbs that, while a liar gains at most a factor of two.
MEASURED_SLACK = 2.0
# How far above the swarm's median speed per block an unmeasured server is believed. Honest
# volunteers differ by about this much (a consumer GPU against a datacenter one); a faster
# server still wins routes at this figure, is measured on its first step, and from then on is
# believed up to what it measured.
UNMEASURED_OVER_MEDIAN = 4.0
# Steps per block per second no server is believed past: one block in a microsecond is beyond
# any accelerator (a kernel launch alone takes several).
MAX_BLOCK_STEPS_PER_S = 1e6


class StepSpeeds(Mapping[str, float]):
    """Smoothed seconds one token spends in one block of each server, as this client timed its
    steps; servers never timed are absent."""

    def __init__(self, *, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self._seconds: dict[str, float] = {}

    def record(
        self, peer_id: str, *, blocks: int, tokens: int, seconds: float, rtt_s: float = 0.0
    ) -> float | None:
        """Fold one step into the estimate: `tokens` tokens ran through `blocks` of the server's
        blocks and answered `seconds` after they were sent, `rtt_s` of which was the network
        round trip. Returns the new estimate, or None when the step taught nothing (no blocks
        or tokens, or it answered within the round trip, so the network hid the compute).

        Dividing by tokens makes a long prefill look fast per token, which only ever credits a
        server with more, never less, than its decode speed.
        """
        for name, value in (("seconds", seconds), ("rtt_s", rtt_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        compute = seconds - rtt_s
        if blocks <= 0 or tokens <= 0 or compute <= 0:
            return None
        sample = compute / (blocks * tokens)
        old = self._seconds.get(peer_id)
        new = sample if old is None else old + self.alpha * (sample - old)
        self._seconds[peer_id] = new
        return new

    def forget(self, peer_id: str) -> None:
        """Drop a peer that left the swarm."""
        self._seconds.pop(peer_id, None)

    def __getitem__(self, peer_id: str) -> float:
        return self._seconds[peer_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._seconds)

    def __len__(self) -> int:
        return len(self._seconds)


def block_speed(record: ServerRecord) -> float:
    """Steps per second one of the record's blocks runs, as announced (throughput is per span)."""
    return record.throughput * record.num_blocks


def credible_throughputs(
    records: Iterable[ServerRecord], measured: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Per peer, the throughput routing plans with: the announced one, bounded by what was
    measured (`measured`: seconds per token per block, as `StepSpeeds` holds them) or, for a
    server never measured, by the swarm's median (see the module docstring)."""
    records = list(records)
    measured = measured or {}
    routable = sorted(
        block_speed(r) for r in records if r.state in ROUTABLE_STATES and r.throughput > 0
    )
    # The lower median: with two servers it is the slower one, so one liar cannot lift it.
    median = routable[(len(routable) - 1) // 2] if routable else MAX_BLOCK_STEPS_PER_S
    unmeasured_cap = min(UNMEASURED_OVER_MEDIAN * median, MAX_BLOCK_STEPS_PER_S)
    credible: dict[str, float] = {}
    for r in records:
        seconds = measured.get(r.peer_id)
        if seconds is not None and math.isfinite(seconds) and seconds > 0:
            cap = min(MEASURED_SLACK / seconds, MAX_BLOCK_STEPS_PER_S)
        else:
            cap = unmeasured_cap
        credible[r.peer_id] = min(r.throughput, cap / r.num_blocks)
    return credible


def believed_snapshot(
    snapshot: SwarmSnapshot, measured: Mapping[str, float] | None = None
) -> SwarmSnapshot:
    """`snapshot` with each record's throughput lowered to the credible one, for decisions that
    sum throughputs (block selection): one lying record must not make its blocks look so well
    served that every other server leaves them to it."""
    believed = credible_throughputs(snapshot.records, measured)
    records = tuple(
        r
        if believed[r.peer_id] == r.throughput
        else dataclasses.replace(r, throughput=believed[r.peer_id])
        for r in snapshot.records
    )
    if records == snapshot.records:
        return snapshot
    return SwarmSnapshot(snapshot.model, snapshot.num_blocks, records)
