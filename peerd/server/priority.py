"""Who goes first when several peers wait for this server (a turn of the device, a place in the
queue for cache): contributors before takers, in proportion to their standing, while takers keep a
guaranteed share of the work.

Peers with a standing above zero (peerd.server.standing) are contributors, the others takers.
While both classes wait, takers go first whenever their share of the recent work done here is
below `taker_share` (20% by default), and contributors go first otherwise; among contributors,
the one that got the least recent work per unit of standing goes first (so two contributors share
in proportion to their standing); among takers, and whenever only one class waits, the caller's
own fair order holds. Work is what the caller counts (tokens run through our blocks, tokens of
cache admitted), in tallies that halve every `half_life_s`, so the shares follow the current load.

Order alone cannot keep a contributor's latency near its unloaded figure on a loaded server: its
step waits for the takers' turn under way (a turn is not preempted), and on a machine shared with
other servers (the next hops of its route, often) their takers' turns take the cores its forward
needs. So while a contributor stepped here in the last CONTRIBUTOR_ACTIVE_S, takers' turns are
held back (`Reservation`), as peerd.server.compute holds training back while inference is active:
after a turn that ran only takers' work for S seconds, the next such turn waits TAKER_REST * S.
Takers then have at most 1 / (1 + TAKER_REST) of the device (their 20%), a contributor's step
arriving at a random moment finds a takers' turn under way that often and waits half of one on
average, and every server of the route leaves the cores free four fifths of the time. Takers'
turns run in smaller pieces meanwhile, and contributors' rounds take only contributors' steps
(peerd.server.batching: RESERVED_TURN_TOKENS, RESERVED_GATHER_S), and on a CPU server in a
lane at the lowest CPU priority (peerd.server.lane). What it gained and cost on
a loaded local swarm is in docs/swarm.md (Standing, Measured). The rest never takes the takers'
guarantee: while their recent share of the work is under `taker_share`
they are not held back at all; and it costs nothing when no contributor is about (the takers then
have the whole device, as before).

`enabled=False` (`peerd start --priority fifo`) keeps the caller's order for everyone and only
counts, so both modes report the share of work that went to contributors; it never holds anyone
back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from peerd.server.standing import Standing

T = TypeVar("T")

# Takers' guaranteed share of the work while contributors wait too: newcomers and pure clients are
# never starved, and a contributor's priority is bounded.
TAKER_SHARE = 0.2
# Tallies of recent work halve this often: long enough to span many turns, short enough that a
# burst a minute ago does not decide who goes now.
HALF_LIFE_S = 30.0

# Takers' turns are held back while a contributor stepped here this recently: a contributor's
# steps come once per token of each of its sessions (0.15-0.8 s apart on a loaded CPU swarm), so
# two seconds spans the gaps between its tokens, and a new generation's first step, but ends the
# takers' rests soon after it stops.
CONTRIBUTOR_ACTIVE_S = 2.0
# Meanwhile a turn of takers' work alone that ran S seconds is followed by TAKER_REST * S in which
# no other such turn starts: takers keep their guaranteed share of the device's time and no more
# (a fifth: 1 / (1 + TAKER_REST) = TAKER_SHARE), and a contributor's step arriving at a random
# moment finds a takers' turn under way a fifth of the time. Measured on the fairness bench (3
# servers and the clients on 2 cores): with a rest of 2 S (a third) contributors' tokens took
# 2.2-3.8x their unloaded time; with 4 S, 1.5-2.2x.
TAKER_REST = 4.0  # (1 - TAKER_SHARE) / TAKER_SHARE

CONTRIBUTOR, TAKER = "contributor", "taker"


class _Tally:
    """Work, halving every half_life_s."""

    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value, self.at = 0.0, 0.0

    def get(self, now: float, half_life_s: float) -> float:
        return self.value * math.exp2(-(now - self.at) / half_life_s) if self.value else 0.0

    def add(self, work: float, now: float, half_life_s: float) -> None:
        self.value, self.at = self.get(now, half_life_s) + work, now


class Priority:
    """The order in which waiting peers are served, and the work each class got."""

    def __init__(
        self,
        standing: Standing,
        *,
        enabled: bool = True,
        taker_share: float = TAKER_SHARE,
        half_life_s: float = HALF_LIFE_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not 0 <= taker_share <= 1 or half_life_s <= 0:
            raise ValueError("taker_share must be in [0, 1] and half_life_s > 0")
        self.standing = standing
        self.enabled = enabled
        self.taker_share = taker_share
        self.half_life_s = half_life_s
        self.clock = clock or standing.clock
        self._classes = {CONTRIBUTOR: _Tally(), TAKER: _Tally()}
        self._peers: dict[str, _Tally] = {}  # contributors' recent work
        self.totals = {CONTRIBUTOR: 0.0, TAKER: 0.0}  # all the work, by class

    def takers_owed(self, now: float | None = None) -> bool:
        """Takers' recent share of the work is below their guarantee."""
        now = self.clock() if now is None else now
        taker = self._classes[TAKER].get(now, self.half_life_s)
        total = taker + self._classes[CONTRIBUTOR].get(now, self.half_life_s)
        return total > 0 and taker < self.taker_share * total

    def order(self, items: Sequence[T], owner: Callable[[T], str]) -> list[T]:
        """`items` (in the caller's fair order) in the order they should be served."""
        if not self.enabled or len(items) < 2:
            return list(items)
        now = self.clock()
        standing = {peer: self.standing.of(peer, now) for peer in {owner(i) for i in items}}
        contributors = [i for i in items if standing[owner(i)] > 0]
        takers = [i for i in items if standing[owner(i)] <= 0]
        if len(contributors) > 1:
            rank = {id(item): n for n, item in enumerate(contributors)}

            def key(item: T) -> tuple[float, int]:
                peer = owner(item)
                tally = self._peers.get(peer)
                got = tally.get(now, self.half_life_s) if tally else 0.0
                return (got / standing[peer], rank[id(item)])

            contributors.sort(key=key)
        if takers and contributors and self.takers_owed(now):
            return takers + contributors
        return contributors + takers

    def is_contributor(self, peer: str, now: float | None = None) -> bool:
        return self.standing.of(peer, now) > 0

    def account(self, peer: str, work: float) -> None:
        """`peer` was given `work` (tokens)."""
        if work <= 0:
            return
        now = self.clock()
        kind = CONTRIBUTOR if self.standing.of(peer, now) > 0 else TAKER
        self._classes[kind].add(work, now, self.half_life_s)
        self.totals[kind] += work
        if kind == CONTRIBUTOR:
            self._peers.setdefault(peer, _Tally()).add(work, now, self.half_life_s)
        if len(self._peers) > 4096:  # peers ids are free: keep the ones with recent work
            for key in [k for k, t in self._peers.items() if t.get(now, self.half_life_s) < 1]:
                del self._peers[key]

    def contributor_share(self) -> float:
        """The share of all the work counted so far that went to contributors (0 with none)."""
        total = sum(self.totals.values())
        return self.totals[CONTRIBUTOR] / total if total else 0.0


class Reservation:
    """The device held back from takers while a contributor is active here (module docstring).

    Pure: every method takes `now` on the caller's clock (the batcher's trio clock), which need
    not be the standing's own."""

    def __init__(
        self,
        priority: Priority,
        *,
        active_s: float = CONTRIBUTOR_ACTIVE_S,
        rest: float = TAKER_REST,
    ) -> None:
        if active_s < 0 or rest < 0:
            raise ValueError("active_s and rest must be >= 0")
        self.priority = priority
        self.active_s, self.rest = active_s, rest
        self.contributor_at = -math.inf  # when a contributor last stepped here
        self.takers_free_at = -math.inf  # when the next turn of takers' work alone may start
        self.rests = 0  # rests imposed after takers' turns
        # their length in all (a rest cut short because the contributor went quiet counts whole)
        self.rested_s = 0.0

    def stepped(self, peer: str, now: float) -> None:
        """`peer` sent a step at `now`."""
        if self.priority.enabled and self.priority.is_contributor(peer):
            self.contributor_at = now

    def active(self, now: float) -> bool:
        """Takers' turns are held back now: by standing, a contributor stepped lately, and
        takers are not owed their share."""
        return (
            self.priority.enabled
            and now - self.contributor_at <= self.active_s
            and not self.priority.takers_owed()
        )

    def taker_turn_ran(self, ran_s: float, now: float) -> None:
        """A turn of takers' work alone ended at `now` after `ran_s` seconds."""
        if ran_s > 0 and self.rest > 0 and self.active(now):
            rest = self.rest * ran_s
            self.takers_free_at = now + rest
            self.rests += 1
            self.rested_s += rest

    def taker_wait(self, now: float) -> float:
        """Seconds from `now` until a turn of takers' work alone may start (0: it may now)."""
        if now >= self.takers_free_at or not self.active(now):
            return 0.0
        return self.takers_free_at - now
