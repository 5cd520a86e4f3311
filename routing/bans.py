"""Temporary bans of peers that failed us, with exponential backoff per peer.

A peer that fails a request is skipped by route planning for a while: 1 s after the first
failure, doubling with each further failure up to a cap, and forgiven entirely on its next
success. A peer caught returning wrong results is banned for a fixed, long time that no later
success shortens (`ban_liar`). The clock is the caller's (`now` in seconds, e.g.
`trio.current_time()`), so tests drive time by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A first failure is often a blip (a stream reset, a server busy for a moment): retry soon.
DEFAULT_BASE_BAN_S = 1.0
# A peer that keeps failing is still retried every 5 minutes in case it recovered; longer and
# a restarted volunteer would sit unused, shorter and a dead one keeps costing timeouts.
DEFAULT_MAX_BAN_S = 300.0
# A peer caught lying (wrong results, checked against two others) is not a blip: it stays out
# for a day, whatever else it answers correctly meanwhile.
DEFAULT_LIAR_BAN_S = 86400.0


@dataclass
class _Strikes:
    failures: int
    banned_until: float


class BanList:
    """Which peers to avoid right now, and for how long."""

    def __init__(
        self, *, base_s: float = DEFAULT_BASE_BAN_S, max_s: float = DEFAULT_MAX_BAN_S
    ) -> None:
        if not (math.isfinite(base_s) and base_s > 0):
            raise ValueError(f"base_s must be a finite number > 0, got {base_s!r}")
        if not (math.isfinite(max_s) and max_s >= base_s):
            raise ValueError(f"max_s must be finite and >= base_s ({base_s}), got {max_s!r}")
        self.base_s = base_s
        self.max_s = max_s
        self._strikes: dict[str, _Strikes] = {}
        self._liars: dict[str, float] = {}  # peer -> when its liar's ban ends

    def record_failure(self, peer_id: str, now: float) -> float:
        """Ban `peer_id` after a failure at `now`; return when the ban ends.

        A failure reported while the peer is already banned (other requests that were in flight
        when it went down) does not lengthen the ban: one outage counts once.
        """
        strikes = self._strikes.get(peer_id)
        if strikes is None:
            strikes = self._strikes[peer_id] = _Strikes(failures=0, banned_until=-math.inf)
        elif now < strikes.banned_until:
            return strikes.banned_until
        strikes.failures += 1
        # min() before the power would overflow for a peer that failed a thousand times.
        exponent = min(strikes.failures - 1, 64)
        strikes.banned_until = now + min(self.base_s * 2.0**exponent, self.max_s)
        return strikes.banned_until

    def ban_liar(self, peer_id: str, now: float, seconds: float = DEFAULT_LIAR_BAN_S) -> float:
        """Ban `peer_id` for `seconds` from `now` for returning wrong results; return when the ban
        ends. record_success does not lift it."""
        until = max(self._liars.get(peer_id, -math.inf), now + seconds)
        self._liars[peer_id] = until
        return until

    def is_liar(self, peer_id: str, now: float) -> bool:
        return now < self._liars.get(peer_id, -math.inf)

    def record_success(self, peer_id: str) -> None:
        """Forgive `peer_id` completely: its next failure starts again at the base ban."""
        self._strikes.pop(peer_id, None)

    def is_banned(self, peer_id: str, now: float) -> bool:
        if self.is_liar(peer_id, now):
            return True
        strikes = self._strikes.get(peer_id)
        return strikes is not None and now < strikes.banned_until

    def banned_until(self, peer_id: str) -> float | None:
        """When the current or last ban of `peer_id` ends; None if it has no failures."""
        strikes = self._strikes.get(peer_id)
        return None if strikes is None else strikes.banned_until

    def failures(self, peer_id: str) -> int:
        """Failures since the last success."""
        strikes = self._strikes.get(peer_id)
        return 0 if strikes is None else strikes.failures

    def banned(self, now: float) -> frozenset[str]:
        """Every peer banned at `now`."""
        failed = {p for p, s in self._strikes.items() if now < s.banned_until}
        return frozenset(failed | {p for p, until in self._liars.items() if now < until})
