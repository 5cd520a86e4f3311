"""Round-trip times to peers, exponentially smoothed so one slow ping does not reroute a swarm.

`RttTracker` is a read-only `Mapping[peer_id, seconds]` over its estimates, which is exactly what
`plan_route(rtts=...)` takes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

# Weight of the newest sample. 0.2 follows TCP's smoothed RTT (RFC 6298 uses 1/8 for the mean):
# a lasting change shows within a handful of pings, a single outlier moves the estimate 20%.
DEFAULT_ALPHA = 0.2
# What a timed-out ping or failed request counts as: slow enough that the planner prefers any
# peer that answers, finite so a peer that recovers can earn its way back.
DEFAULT_FAILURE_RTT_S = 2.0


class RttTracker(Mapping[str, float]):
    """Smoothed RTT in seconds per peer; peers never measured are absent."""

    def __init__(
        self, *, alpha: float = DEFAULT_ALPHA, failure_rtt_s: float = DEFAULT_FAILURE_RTT_S
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not (math.isfinite(failure_rtt_s) and failure_rtt_s >= 0):
            raise ValueError(f"failure_rtt_s must be finite and >= 0, got {failure_rtt_s!r}")
        self.alpha = alpha
        self.failure_rtt_s = failure_rtt_s
        self._rtt: dict[str, float] = {}

    def record(self, peer_id: str, rtt_s: float) -> float:
        """Fold a measured round trip into the estimate; return the new estimate.

        The first sample is taken as is: smoothing it against zero would make an unknown
        peer look fast.
        """
        if not (math.isfinite(rtt_s) and rtt_s >= 0):
            raise ValueError(f"an RTT must be a finite number of seconds >= 0, got {rtt_s!r}")
        old = self._rtt.get(peer_id)
        new = rtt_s if old is None else old + self.alpha * (rtt_s - old)
        self._rtt[peer_id] = new
        return new

    def record_failure(self, peer_id: str) -> float:
        """Count a timeout or failed request as a slow sample; return the new estimate.

        The sample is `failure_rtt_s`, or the current estimate if that is already worse: a
        failure never makes a peer look faster.
        """
        return self.record(peer_id, max(self.failure_rtt_s, self._rtt.get(peer_id, 0.0)))

    def forget(self, peer_id: str) -> None:
        """Drop a peer that left the swarm."""
        self._rtt.pop(peer_id, None)

    def __getitem__(self, peer_id: str) -> float:
        return self._rtt[peer_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rtt)

    def __len__(self) -> int:
        return len(self._rtt)
