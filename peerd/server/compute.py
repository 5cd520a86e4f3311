"""The compute queue of one device: torch work runs in a worker thread, one job at a time, with
inference steps served before forward/backward passes of training."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")
R = TypeVar("R")

PRIORITY_INFERENCE = 0
PRIORITY_TRAINING = 1


class ComputeQueue:
    """Runs blocking torch calls off the event loop so the loop keeps draining streams (yamux
    resets a writer whose reader stalls 5 s), one at a time per device, lowest priority first."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, trio.Event]] = []
        self._order = itertools.count()
        self.jobs_done = 0

    @property
    def depth(self) -> int:
        return len(self._waiting) + int(self._busy)

    async def run(self, priority: int, fn: Callable[..., T], *args: object) -> T:
        if self._busy or self._waiting:
            ready = trio.Event()
            entry = (priority, next(self._order), ready)
            heapq.heappush(self._waiting, entry)
            try:
                await ready.wait()
            except BaseException:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
                else:  # we were handed the device while being cancelled: pass it on
                    self._release()
                raise
        self._busy = True
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self.jobs_done += 1
            self._release()

    def _release(self) -> None:
        if self._waiting:
            _, _, ready = heapq.heappop(self._waiting)
            ready.set()  # ownership passes straight to the next job: _busy stays True
        else:
            self._busy = False
