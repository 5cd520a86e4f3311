"""The compute queue of one device: torch work runs on the process's compute thread, one job at a
time, with inference steps served before forward/backward passes of training.

Going first is not enough for inference when training floods a server: every step still waits
for the slice under way, and on a machine shared with other daemons (the next hops of the same
route, often) training slices back to back take the cores they need. So while inference ran
here in the last INFERENCE_ACTIVE_S, training slices pass one at a time (`training_slice`) and
rest after each (`training_rest`): as long as it ran, so training gets at most half of the device
while someone generates (and all of it otherwise), and longer still for a slice longer than
SLICE_S (one long row: attention needs the whole sequence in one slice), so that a step arriving
at any moment waits about SLICE_S / 2 on average, up to slices of MAX_REST * SLICE_S."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from peerd.node import compute_thread
from peerd.server.memory import MemoryTrim

T = TypeVar("T")
R = TypeVar("R")

PRIORITY_INFERENCE = 0
PRIORITY_TRAINING = 1
# Inference counts as active this long after its last job; a training slice then rests this many
# times its own run time before the next one may start.
INFERENCE_ACTIVE_S = 2.0
TRAINING_REST = 1.0
# A slice that ran S > SLICE_S seconds rests S * S / SLICE_S: training's share of the device is
# then SLICE_S / (SLICE_S + S), and the wait it adds to a step arriving at a random moment
# (that share times S / 2) stays under SLICE_S / 2; but never more than MAX_REST times S, so
# training keeps a fifth of the device (peerd.server.training's token cap counts on it).
SLICE_S = 0.25
MAX_REST = 4.0
# A job offered `inline` runs on the event loop when the device is free and the last job offered
# so took at most this long: for a few milliseconds of work nobody waits behind, the compute
# thread's two switches cost more than the loop loses (a loop busy for tens of milliseconds
# delays nothing; yamux resets a stream only after 5 s). Only single-threaded passes are offered:
# a second OpenMP team on the loop's thread would slow every pass (peerd.node.compute_thread).
INLINE_MAX_S = 0.05


def training_rest(ran_s: float) -> float:
    """How long a training slice that ran `ran_s` seconds rests while inference is active."""
    return ran_s * min(MAX_REST, max(TRAINING_REST, ran_s / SLICE_S))


class ComputeQueue:
    """Runs blocking torch calls off the event loop so the loop keeps draining streams (yamux
    resets a writer whose reader stalls 5 s), one at a time per device, lowest priority first."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, trio.Event]] = []
        self._order = itertools.count()
        self.jobs_done = 0
        self._inline_s = float("inf")  # how long the last job offered inline took
        # trio.current_time() when an inference job last came or finished
        self.last_inference = -float("inf")
        self._training_lane = trio.Lock()
        self.training_rested_s = 0.0
        self.memory = MemoryTrim()  # gives the memory training work freed back to the system

    @property
    def depth(self) -> int:
        return len(self._waiting) + int(self._busy)

    async def run(
        self, priority: int, fn: Callable[..., T], *args: object, inline: bool = False
    ) -> T:
        """fn(*args) on the device (on the process's compute thread, peerd.node.compute_thread),
        after the jobs ahead of it. `inline`: a short job, to run here on the event loop if the
        device is free (INLINE_MAX_S); offer it only for a pass that runs on one torch thread."""
        if priority == PRIORITY_INFERENCE:
            # Demand counts, not only completion: a step that waited for a slice longer than
            # INFERENCE_ACTIVE_S (a long row on a loaded machine) makes that slice rest too.
            self.last_inference = trio.current_time()
        if inline and not self._busy and not self._waiting and self._inline_s <= INLINE_MAX_S:
            self._busy = True
            try:
                return self._timed(fn, *args)
            finally:
                self._done(priority)
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
            # Let the tasks ready now (steps that came with this one) queue first: the job picks
            # its batch when it starts, and the compute thread starts it at once.
            await trio.lowlevel.cancel_shielded_checkpoint()
            if inline:
                return await compute_thread.run(self._timed, fn, *args)
            return await compute_thread.run(fn, *args)
        finally:
            self._done(priority)

    def _timed(self, fn: Callable[..., T], *args: object) -> T:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._inline_s = time.perf_counter() - started

    def _done(self, priority: int) -> None:
        self.jobs_done += 1
        if priority == PRIORITY_INFERENCE:
            self.last_inference = trio.current_time()
        self._release()

    async def training_slice(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) as a training job: one training slice at a time, each resting at least as
        long as it ran (training_rest) while inference is active here, so a flood of training
        keeps at most half of the device (and of the machine's cores) from the servers'
        inference."""
        async with self._training_lane:
            started = trio.current_time()
            result = await self.run(PRIORITY_TRAINING, fn, *args)
            await self.memory.after_work()  # off the device: an inference step may run
            if trio.current_time() - self.last_inference < INFERENCE_ACTIVE_S:
                rest = training_rest(trio.current_time() - started)
                self.training_rested_s += rest
                await trio.sleep(rest)
            return result

    def _release(self) -> None:
        if self._waiting:
            _, _, ready = heapq.heappop(self._waiting)
            ready.set()  # ownership passes straight to the next job: _busy stays True
        else:
            self._busy = False
