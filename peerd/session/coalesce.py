"""Concurrent calls whose work is cheaper done together run as one batch on the compute thread."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio

from peerd.node import compute_thread

T = TypeVar("T")
R = TypeVar("R")


# A batch about to run waits for the members that have not called yet (each comes back once its
# step returns), for this fraction of the time between the caller's calls, within these bounds
# (peerd.server.batching gathers a forward's partners the same way). A member's first call has
# no period yet: it waits GATHER_FIRST_S, enough for prefills of prompts of other lengths.
GATHER_FRACTION = 0.25
GATHER_MAX_S = 0.1
GATHER_FIRST_S = 0.03
# Only members due by then are waited for (_Member.due): not one whose calls come far apart (a
# slower route), nor a late one, nor one still in its prefill after this long.
ACTIVE_S = 1.0


@dataclass(eq=False)
class _Call(Generic[T, R]):
    item: T
    key: Hashable | None = None
    result: R | None = None
    error: Exception | None = None
    finished: bool = False


@dataclass
class _Member:
    joined: float
    group: int | None = 0  # its micro-batch (Coalescer `micro_batches`); None: never split
    last: float | None = None  # when it last called
    period: float | None = None  # smoothed time between its calls

    def due(self, now: float, deadline: float, period_hint: float | None) -> bool:
        """Its next call may well come by `deadline`. A member that has not called yet (its
        prefill runs) is due for ACTIVE_S; one that called once steps about as often as the
        caller (`period_hint`); one late by more than its period is not due (its reader
        stopped, or its step is stuck)."""
        if self.last is None:
            return now - self.joined < ACTIVE_S
        period = self.period if self.period is not None else period_hint
        if period is None:
            return False
        expected = self.last + period
        return expected - GATHER_FRACTION * period <= deadline and now - expected < period


class Coalescer(Generic[T, R]):
    """Concurrent calls whose work is cheaper done together: calls that arrive while a batch runs
    (in a worker thread) wait, then go together in the next. `run_batch(items)` returns one
    result per item; an exception it raises fails every call of that batch.

    For work bound by reading weights, like the LM head of many sessions' next tokens: one
    matrix product over all their rows reads the weights once.

    Callers that call again and again (a generation, once a token) join as members (`member`):
    a batch about to run first waits, briefly (GATHER_*), for the members that have not called
    yet. So concurrent generations sample their tokens in one pass and send their next steps
    together, and the servers of their route merge those into one forward, instead of the
    first to arrive running alone and the generations drifting into groups.

    With `micro_batches` > 1, once `split_members` or more members are in, they split into that
    many groups of about equal size, each gathering and running its own batches: the work each
    batch feeds next (the generations' steps through a route of servers) then flows in
    micro-batches, one group's on one hop while another's is on the next (`group_of` says which
    group a member's calls run in)."""

    def __init__(
        self,
        run_batch: Callable[[list[T]], list[R]],
        run_sync: Callable[..., Awaitable[Any]] = compute_thread.run,
        inline_max_s: float = 0.0,
        micro_batches: int = 1,
        split_members: int = 4,
    ) -> None:
        """`inline_max_s`: a lone caller's batch of one runs on the event loop instead, once such
        a batch took at most this long (a worker thread's two switches then cost more than
        the loop loses)."""
        if micro_batches < 1 or split_members < micro_batches:
            raise ValueError(
                f"micro_batches {micro_batches}, split_members {split_members}: give "
                "1 <= micro_batches <= split_members"
            )
        self._micro_batches = micro_batches
        self._split_members = split_members
        self._run_batch = run_batch
        self._run_sync = run_sync  # how a batch runs: on the compute thread
        self._inline_max_s = inline_max_s
        self._lone_s = float("inf")  # how long the last batch of one call took
        self._pending: list[_Call[T, R]] = []
        self._running = False
        self._batch_over = trio.Event()
        self._members: dict[Hashable, _Member] = {}
        self._changed = trio.Event()  # a call came or a member left
        self.batches = 0

    @contextlib.contextmanager
    def member(self, key: Hashable, split: bool = True) -> Iterator[None]:
        """While in this block, calls with `key` are one member's: batches wait for it. A member
        that may not `split` runs with the others that may not, apart from the micro-batches."""
        sizes = self._group_sizes()
        group = min(range(self._micro_batches), key=lambda g: sizes[g]) if split else None
        self._members[key] = _Member(joined=trio.current_time(), group=group)
        try:
            yield
        finally:
            del self._members[key]
            self._rebalance()
            self._notify()

    def group_of(self, key: Hashable) -> int | None:
        """The micro-batch `key`'s calls run in; None while the members that may split are too
        few (each call then runs with any other), for one that may not, and for a non-member."""
        return self._groups().get(key)

    def _groups(self) -> dict[Hashable, int | None]:
        """Every member's micro-batch now (group_of), in one pass over the members."""
        if self._micro_batches == 1 or sum(self._group_sizes()) < self._split_members:
            return dict.fromkeys(self._members)
        return {key: member.group for key, member in self._members.items()}

    def _group_sizes(self) -> list[int]:
        sizes = [0] * self._micro_batches
        for member in self._members.values():
            if member.group is not None:
                sizes[member.group] += 1
        return sizes

    def _rebalance(self) -> None:
        """After a member left: the latest to join of the largest group moves to the smallest
        while they differ by more than one."""
        while True:
            sizes = self._group_sizes()
            large, small = sizes.index(max(sizes)), sizes.index(min(sizes))
            if sizes[large] - sizes[small] <= 1:
                return
            members = reversed(self._members.values())
            latest = next(m for m in members if m.group == large)
            latest.group = small

    async def __call__(self, item: T, key: Hashable | None = None) -> R:
        call: _Call[T, R] = _Call(item, key)
        wait, period = self._called(key)
        self._pending.append(call)
        self._notify()
        try:
            while not call.finished:
                if self._running:
                    await self._batch_over.wait()
                    continue
                await self._gather(trio.current_time() + wait, period, self.group_of(key))
                if self._running or call.finished:
                    continue
                groups = self._groups()  # anew: members may have left meanwhile
                batch = [c for c in self._pending if groups.get(c.key) == groups.get(key)]
                self._pending = [c for c in self._pending if c not in batch]
                self._running = True
                try:
                    results = await self._run(batch)
                except Exception as e:
                    for c in batch:
                        c.error, c.finished = e, True
                else:
                    for c, result in zip(batch, results, strict=True):
                        c.result, c.finished = result, True
                finally:
                    self.batches += 1
                    # A cancelled runner leaves the others of its batch to run in the next one.
                    self._pending[:0] = [c for c in batch if not c.finished and c is not call]
                    self._running = False
                    over, self._batch_over = self._batch_over, trio.Event()
                    over.set()
                    self._notify()
        finally:
            if call in self._pending:
                self._pending.remove(call)
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    async def _run(self, batch: list[_Call[T, R]]) -> list[R]:
        items = [c.item for c in batch]
        lone = len(batch) == 1
        started = time.perf_counter()
        if lone and self._lone_s <= self._inline_max_s and len(self._members) <= 1:
            results = self._run_batch(items)
        else:
            results = await self._run_sync(self._run_batch, items)
        if lone:
            self._lone_s = time.perf_counter() - started
        return results

    def _called(self, key: Hashable | None) -> tuple[float, float | None]:
        """Note a member's call: how long a batch it starts may wait for the other members, and
        its period."""
        member = self._members.get(key) if key is not None else None
        if member is None:
            return 0.0, None
        now = trio.current_time()
        if member.last is not None:
            interval = now - member.last
            member.period = (
                interval if member.period is None else 0.7 * member.period + 0.3 * interval
            )
        member.last = now
        if member.period is None:
            return GATHER_FIRST_S, None
        return min(GATHER_FRACTION * member.period, GATHER_MAX_S), member.period

    async def _gather(self, deadline: float, period: float | None, group: int | None) -> None:
        """Until every member of `group` due has a call pending, or `deadline`, or a batch runs."""
        while not self._running and (now := trio.current_time()) < deadline:
            pending = {c.key for c in self._pending}
            groups = self._groups()
            members = [(k, m) for k, m in self._members.items() if groups[k] == group]
            if all(k in pending or not m.due(now, deadline, period) for k, m in members):
                return
            with trio.move_on_at(deadline):
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
