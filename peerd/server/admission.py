"""Admission control of a block server: who may open a session and send work, and who waits.

A session that asks for more KV cache than is free waits in a FIFO queue (first come, first
served: a big request is not starved by small ones arriving after it) until sessions close and
free enough, or until the wait the client stated in its OpenSession passes; then it is refused
with `cache_full_timeout`, saying how many tokens it asked for and how many were free. Each peer
may hold a bounded number of sessions (open or queued) and a bounded number of bytes of steps
in flight (received and not yet answered), so one heavy peer cannot take the server from the
others: whoever exceeds a limit gets a typed refusal, everyone else keeps being served.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import trio

import wire
from blocks import CacheFull, MemoryCache, SpanSession

# The longest a request may wait for cache, whatever its client asks: a queued request holds a
# stream and a slot, and a client that waits longer is better off trying another server.
MAX_ADMISSION_WAIT_S = 60.0
# Requests waiting at once; past this the server is plainly overloaded and says `busy`.
MAX_QUEUED_SESSIONS = 256


class Refused(Exception):
    """A request this server turns down now; `code` is the wire Error's code (wire.ErrorCode)."""

    def __init__(self, code: wire.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class AdapterMissing(wire.ProtocolError):
    """A session asked for a LoRA adapter this server does not have (Error adapter_not_found)."""


class Admission:
    """The queue for cache and the per-peer counters of one block server (one trio thread)."""

    def __init__(
        self,
        *,
        max_sessions_per_peer: int,
        max_inflight_bytes_per_peer: int,
        max_queued: int = MAX_QUEUED_SESSIONS,
        max_wait_s: float = MAX_ADMISSION_WAIT_S,
    ) -> None:
        self.max_sessions_per_peer = max_sessions_per_peer
        self.max_inflight_bytes_per_peer = max_inflight_bytes_per_peer
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self._sessions: dict[str, int] = {}  # peer -> sessions open or queued
        self._inflight: dict[str, int] = {}  # peer -> bytes of steps received, not yet answered
        self._queue: deque[_Waiter] = deque()  # the waiting requests, first in line first
        self._freed = trio.Event()
        self.timeouts = 0  # requests that waited their whole timeout in vain

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

    def cache_freed(self) -> None:
        """A session closed: the waiting requests look again, in order."""
        self._freed.set()
        self._freed = trio.Event()

    async def open_session(
        self,
        cache: MemoryCache,
        batch_size: int,
        max_length: int,
        wait_s: float,
        left_padding: tuple[int, ...] | None = None,
    ) -> SpanSession:
        """A session of batch_size x max_length tokens from `cache`, after waiting in turn up to
        `wait_s` (capped at max_wait_s) for sessions to close; Refused if it does not fit."""
        asked = batch_size * max_length
        if asked > cache.budget_tokens:
            raise Refused(
                wire.ErrorCode.OUT_OF_CACHE,
                f"a session of {asked} tokens (batch {batch_size} x max_length {max_length}) is "
                f"more than this server's whole cache of {cache.budget_tokens} tokens: ask for "
                "a shorter max_length or use another server",
            )
        if not self._queue:
            try:
                return cache.open_session(batch_size, max_length, left_padding)
            except CacheFull:
                pass
        if len(self._queue) >= self.max_queued:
            raise Refused(
                wire.ErrorCode.BUSY,
                f"{len(self._queue)} sessions already wait for cache here: use another server",
            )
        wait_s = min(max(wait_s, 0.0), self.max_wait_s)
        waiter = _Waiter(asked)
        self._queue.append(waiter)
        try:
            with trio.move_on_after(wait_s):
                while True:
                    freed = self._freed
                    if self._queue[0] is waiter:
                        try:
                            return cache.open_session(batch_size, max_length, left_padding)
                        except CacheFull:
                            pass
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


def _add(counts: dict[str, int], peer: str, delta: int) -> None:
    value = counts.get(peer, 0) + delta
    if value:
        counts[peer] = value
    else:
        counts.pop(peer, None)


class _Waiter:
    """One request's place in the queue (compared by identity)."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
