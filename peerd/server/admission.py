"""Admission control of a block server: who may open a session and send work, and who waits.

A session that asks for more KV cache than is free waits in a FIFO queue (first come, first
served: a big request is not starved by small ones arriving after it) until sessions close and
free enough, or until the wait the client stated in its OpenSession passes; then it is refused
with `cache_full_timeout`, saying how many tokens it asked for and how many were free. Each peer
may hold a bounded number of sessions (open or queued), a bounded share of the cache and a
bounded number of bytes of steps in flight (received and not yet answered), so one heavy peer
cannot take the server from the others: whoever exceeds a limit gets a typed refusal, everyone
else keeps being served.

Cache is leased, not held: peer ids cost nothing, so per-peer limits alone cannot stop many
"peers" that reserve cache and never use it. An open session's lease lapses once it has gone
`lease_idle_s` without a step, or has held its tokens for `lease_term_s`; a lapsed lease costs
nothing while nobody waits, but when the request at the head of the queue does not fit, lapsed
sessions are ended (`lease_expired`), the idle ones first (longest idle first), then the ones
whose charge (tokens reserved x seconds held) is largest, only as many as the request needs.
Every session in the cache was opened before the head request arrived (the queue is FIFO), so
that request waits at most `lease_term_s` for its tokens, whoever holds them.

With a `Priority` (peerd.server.priority, `peerd start --priority standing`) the head of the
queue is the first waiter in its order instead: contributors' requests before takers', takers
keeping their guaranteed share of the cache tokens admitted, so a taker's wait is bounded too.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio

import wire
from blocks import CacheFull, MemoryCache, SpanSession
from peerd.server.priority import Priority

# The longest a request may wait for cache, whatever its client asks: a queued request holds a
# stream and a slot, and a client that waits longer is better off trying another server.
MAX_ADMISSION_WAIT_S = 60.0
# Requests waiting at once; past this the server is plainly overloaded and says `busy`.
MAX_QUEUED_SESSIONS = 256
# A session that has not stepped for this long gives its cache up when another request waits
# for cache. Clients step every few hundred ms while they generate; a chat user reading the
# answer idles longer, and when evicted its client replays the history elsewhere (or here).
LEASE_IDLE_S = 5.0
# The longest a session holds its cache while another request waits for cache, however often it
# steps: one that steps a token now and then to keep its hold cannot lock others out. It bounds
# the wait of the request at the head of the queue; a generation longer than this is evicted
# under contention and its client replays it.
LEASE_TERM_S = 30.0
# The share of the cache one peer's sessions (open or queued) may reserve (its first session
# alone may ask for more).
MAX_CACHE_SHARE = 0.5
# Training requests (Forward, Backward) one peer may have queued or running here at once, and
# all peers together: each holds its tensors until answered and takes turns on the device.
MAX_TRAINING_PER_PEER = 2
MAX_TRAINING_INFLIGHT = 16


class Refused(Exception):
    """A request this server turns down now; `code` is the wire Error's code (wire.ErrorCode)."""

    def __init__(self, code: wire.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class AdapterMissing(wire.ProtocolError):
    """A session asked for a LoRA adapter this server does not have (Error adapter_not_found)."""


@dataclass(eq=False)
class Lease:
    """An open session's hold on `tokens` of the cache (see the module docstring)."""

    peer: str
    tokens: int
    opened_at: float
    last_active: float
    # Ends the session (its client hears the Refused): set by whoever serves the session.
    evict: Callable[[Refused], None] | None = None
    stepping: int = 0  # steps of the session queued or computing now
    evicted: bool = False

    @contextmanager
    def step(self) -> Iterator[None]:
        """A step of the session runs: the session is not idle meanwhile."""
        self.stepping += 1
        self.last_active = trio.current_time()
        try:
            yield
        finally:
            self.stepping -= 1
            self.last_active = trio.current_time()

    def idle_s(self, now: float) -> float:
        return 0.0 if self.stepping else now - self.last_active

    def charge(self, now: float) -> float:
        """Token-seconds the session has held its cache."""
        return self.tokens * (now - self.opened_at)


class Admission:
    """The queue for cache, the leases of the open sessions and the per-peer counters of one
    block server (one trio thread)."""

    def __init__(
        self,
        *,
        max_sessions_per_peer: int,
        max_inflight_bytes_per_peer: int,
        max_queued: int = MAX_QUEUED_SESSIONS,
        max_wait_s: float = MAX_ADMISSION_WAIT_S,
        lease_idle_s: float = LEASE_IDLE_S,
        lease_term_s: float = LEASE_TERM_S,
        max_cache_share: float = MAX_CACHE_SHARE,
        max_training_per_peer: int = MAX_TRAINING_PER_PEER,
        max_training_inflight: int = MAX_TRAINING_INFLIGHT,
        priority: Priority | None = None,
    ) -> None:
        self.priority = priority  # who is at the head of the queue (None: first come)
        self.max_sessions_per_peer = max_sessions_per_peer
        self.max_inflight_bytes_per_peer = max_inflight_bytes_per_peer
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self.lease_idle_s = lease_idle_s
        self.lease_term_s = lease_term_s
        self.max_cache_share = max_cache_share
        self.max_training_per_peer = max_training_per_peer
        self.max_training_inflight = max_training_inflight
        self._training: dict[str, int] = {}  # peer -> training requests queued or running
        self._training_done = trio.Event()  # set (and replaced) whenever one of those ends
        self._sessions: dict[str, int] = {}  # peer -> sessions open or queued
        self._inflight: dict[str, int] = {}  # peer -> bytes of steps received, not yet answered
        self._queue: deque[_Waiter] = deque()  # the waiting requests, first in line first
        self._leases: set[Lease] = set()
        self._freed = trio.Event()
        self.timeouts = 0  # requests that waited their whole timeout in vain
        self.evictions = 0  # sessions ended because their lease lapsed while others waited

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        """Cache tokens the waiting requests ask for (routing counts them as taken)."""
        return sum(waiter.tokens for waiter in self._queue)

    def sessions_of(self, peer: str) -> int:
        return self._sessions.get(peer, 0)

    def inflight_bytes_of(self, peer: str) -> int:
        return self._inflight.get(peer, 0)

    @contextmanager
    def session_slot(self, peer: str) -> Iterator[None]:
        """Count one session of `peer` (queued or open) for as long as the block runs."""
        if self.sessions_of(peer) >= self.max_sessions_per_peer:
            raise Refused(
                wire.ErrorCode.TOO_MANY_SESSIONS,
                f"peer {peer} already has {self.max_sessions_per_peer} sessions open or queued "
                "here; close one first or use another server",
            )
        _add(self._sessions, peer, 1)
        try:
            yield
        finally:
            _add(self._sessions, peer, -1)

    @contextmanager
    def inflight(self, peer: str, nbytes: int) -> Iterator[None]:
        """Count `nbytes` of a step of `peer` while it is queued for compute or computing."""
        held = self.inflight_bytes_of(peer)
        if held and held + nbytes > self.max_inflight_bytes_per_peer:
            # One step alone may always run (its size is bounded by the frame limit): otherwise
            # a prefill bigger than the limit could never be served at all.
            raise Refused(
                wire.ErrorCode.INFLIGHT_LIMIT,
                f"peer {peer} already has {held} bytes of steps in flight here and this step "
                f"adds {nbytes}, past the limit of {self.max_inflight_bytes_per_peer}: wait for "
                "the answers before sending more",
            )
        _add(self._inflight, peer, nbytes)
        try:
            yield
        finally:
            _add(self._inflight, peer, -nbytes)

    @contextmanager
    def training_slot(self, peer: str) -> Iterator[None]:
        """Count one training request of `peer` while it is queued or running."""
        if self.training_of(peer) >= self.max_training_per_peer:
            raise Refused(
                wire.ErrorCode.INFLIGHT_LIMIT,
                f"peer {peer} already has {self.max_training_per_peer} training requests queued "
                "or running here: wait for their answers before sending more",
            )
        if sum(self._training.values()) >= self.max_training_inflight:
            raise Refused(
                wire.ErrorCode.BUSY,
                f"{self.max_training_inflight} training requests are queued or running here: "
                "use another server or retry later",
            )
        _add(self._training, peer, 1)
        try:
            yield
        finally:
            _add(self._training, peer, -1)
            self._training_done.set()
            self._training_done = trio.Event()

    def training_of(self, peer: str) -> int:
        return self._training.get(peer, 0)

    @property
    def training_inflight(self) -> int:
        """Training requests of all peers queued or running."""
        return sum(self._training.values())

    async def training_room(self, peer: str) -> None:
        """Wait until `peer` has fewer than max_training_per_peer training requests queued or
        running (its next request would not be refused for its quota)."""
        while self.training_of(peer) >= self.max_training_per_peer:
            await self._training_done.wait()

    def cache_freed(self) -> None:
        """A session closed: the waiting requests look again, in order."""
        self._freed.set()
        self._freed = trio.Event()

    @contextmanager
    def lease(self, peer: str, tokens: int) -> Iterator[Lease]:
        """Lease `tokens` of cache to a session of `peer` while the block runs (the session
        must be open already); leaving it frees them for the queue."""
        now = trio.current_time()
        lease = Lease(peer, tokens, opened_at=now, last_active=now)
        self._leases.add(lease)
        try:
            yield lease
        finally:
            self._leases.discard(lease)
            self.cache_freed()

    def leased_tokens_of(self, peer: str) -> int:
        """Cache tokens the sessions of `peer` hold or wait for."""
        held = sum(lease.tokens for lease in self._leases if lease.peer == peer)
        return held + sum(waiter.tokens for waiter in self._queue if waiter.peer == peer)

    def _check_share(self, peer: str, asked: int, budget: int) -> None:
        share = int(self.max_cache_share * budget)
        held = self.leased_tokens_of(peer)
        # A peer's one session may always ask (up to the whole cache): otherwise a session
        # longer than the share could never be served at all.
        if held and held + asked > share:
            raise Refused(
                wire.ErrorCode.OUT_OF_CACHE,
                f"peer {peer} holds or waits for {held} of this server's {budget} cache tokens "
                f"and asks for {asked} more, past the {share} one peer may hold "
                f"({self.max_cache_share:.0%}): close a session, ask for a shorter max_length "
                "or use another server",
            )

    def reclaimable_tokens(self) -> int:
        """Cache tokens a waiting request could have now: those of lapsed leases, and of
        evicted sessions not yet closed (routing counts them as free)."""
        now = trio.current_time()
        return sum(
            lease.tokens
            for lease in self._leases
            if lease.evicted or (lease.evict is not None and self._lapsed(lease, now))
        )

    def _lapsed(self, lease: Lease, now: float) -> bool:
        return lease.idle_s(now) >= self.lease_idle_s or now - lease.opened_at >= self.lease_term_s

    def _reclaim(self, cache: MemoryCache, needed: int) -> None:
        """End as few lapsed sessions as make room for `needed` tokens (the idle first, longest
        idle first, then the biggest charge); none if all the lapsed ones would not do."""
        now = trio.current_time()
        coming = sum(lease.tokens for lease in self._leases if lease.evicted)
        shortfall = needed - cache.free_tokens - coming
        lapsed = [
            lease
            for lease in self._leases
            if not lease.evicted and lease.evict is not None and self._lapsed(lease, now)
        ]
        if shortfall <= 0 or sum(lease.tokens for lease in lapsed) < shortfall:
            return
        lapsed.sort(
            key=lambda lease: (
                lease.idle_s(now) < self.lease_idle_s,
                -lease.idle_s(now),
                -lease.charge(now),
            )
        )
        for lease in lapsed:
            if shortfall <= 0:
                break
            shortfall -= lease.tokens
            self._evict(lease, now)

    def _evict(self, lease: Lease, now: float) -> None:
        assert lease.evict is not None
        lease.evicted = True
        self.evictions += 1
        idle = lease.idle_s(now)
        why = (
            f"it sent no step for {idle:.0f} s (the limit is {self.lease_idle_s:.0f} s)"
            if idle >= self.lease_idle_s
            else f"it held them for {now - lease.opened_at:.0f} s (the limit is "
            f"{self.lease_term_s:.0f} s)"
        )
        lease.evict(
            Refused(
                wire.ErrorCode.LEASE_EXPIRED,
                f"this server took back the session's {lease.tokens} cache tokens for a request "
                f"waiting for cache: {why}; open a new session (here or elsewhere) and replay "
                "its inputs",
            )
        )

    def _next_lapse(self, now: float) -> float:
        """Seconds until the next lease lapses (inf: none will by itself)."""
        times = [
            min(
                lease.opened_at + self.lease_term_s,
                math.inf if lease.stepping else lease.last_active + self.lease_idle_s,
            )
            for lease in self._leases
            if not lease.evicted and lease.evict is not None
        ]
        return min((t for t in times if t > now), default=math.inf) - now

    async def open_session(
        self,
        cache: MemoryCache,
        batch_size: int,
        max_length: int,
        wait_s: float,
        left_padding: tuple[int, ...] | None = None,
        peer: str = "",
    ) -> SpanSession:
        """A session of batch_size x max_length tokens from `cache`, after waiting in turn up to
        `wait_s` (capped at max_wait_s) for sessions to close or leases to lapse; Refused if it
        does not fit. The caller leases the session's tokens (`lease`) before its next await."""
        asked = batch_size * max_length
        if asked > cache.budget_tokens:
            raise Refused(
                wire.ErrorCode.OUT_OF_CACHE,
                f"a session of {asked} tokens (batch {batch_size} x max_length {max_length}) is "
                f"more than this server's whole cache of {cache.budget_tokens} tokens: ask for "
                "a shorter max_length or use another server",
            )
        if peer:
            self._check_share(peer, asked, cache.budget_tokens)
        if not self._queue:
            try:
                return self._open(cache, peer, batch_size, max_length, left_padding)
            except CacheFull:
                pass
        if len(self._queue) >= self.max_queued:
            raise Refused(
                wire.ErrorCode.BUSY,
                f"{len(self._queue)} sessions already wait for cache here: use another server",
            )
        wait_s = min(max(wait_s, 0.0), self.max_wait_s)
        waiter = _Waiter(asked, peer)
        self._queue.append(waiter)
        try:
            with trio.move_on_after(wait_s):
                while True:
                    freed = self._freed
                    if self._head() is waiter:
                        try:
                            return self._open(cache, peer, batch_size, max_length, left_padding)
                        except CacheFull:
                            self._reclaim(cache, asked)
                    # Wake when a session closes or the next lease lapses.
                    with trio.move_on_after(self._next_lapse(trio.current_time())):
                        await freed.wait()
        finally:
            self._queue.remove(waiter)
            self.cache_freed()  # the next in line may fit now that we left
        self.timeouts += 1
        free = cache.free_tokens
        raise Refused(
            wire.ErrorCode.CACHE_FULL_TIMEOUT,
            f"this server's attention cache had {free} of {cache.budget_tokens} tokens free "
            f"after waiting {wait_s:.1f} s, and the session asks for {asked} (batch {batch_size}"
            f" x max_length {max_length}): try another server, a shorter max_length, or a "
            "longer wait",
        )

    def _head(self) -> _Waiter:
        """The waiter whose turn it is: the first one, or the first in the priority's order."""
        if self.priority is None:
            return self._queue[0]
        return self.priority.order(self._queue, lambda waiter: waiter.peer)[0]

    def _open(
        self,
        cache: MemoryCache,
        peer: str,
        batch_size: int,
        max_length: int,
        left_padding: tuple[int, ...] | None,
    ) -> SpanSession:
        """A session from `cache` (CacheFull if it does not fit), counted for `peer` in the
        priority's shares."""
        session = cache.open_session(batch_size, max_length, left_padding)
        if self.priority is not None:
            self.priority.account(peer, session.tokens)
        return session


def _add(counts: dict[str, int], peer: str, delta: int) -> None:
    value = counts.get(peer, 0) + delta
    if value:
        counts[peer] = value
    else:
        counts.pop(peer, None)


class _Waiter:
    """One request's place in the queue (compared by identity)."""

    __slots__ = ("peer", "tokens")

    def __init__(self, tokens: int, peer: str = "") -> None:
        self.tokens = tokens
        self.peer = peer
