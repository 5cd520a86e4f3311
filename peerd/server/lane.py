"""A worker thread at the lowest CPU priority: where a CPU server runs takers' turns while a
contributor is active (peerd.server.batching).

Holding takers back between their turns (priority.Reservation) leaves two costs to a
contributor's step on a loaded CPU server: it waits for the takers' turn under way (a forward is
not preempted), and its own forward shares the cores with the takers' turns of every other
process on the machine (the other servers of its route, often). Run in this lane instead of on the
compute queue, a takers' turn no longer holds the device, so the contributor's step starts at
once, and it runs at nice LANE_NICE, so the kernel gives the cores to the nice-0 threads that want
them (the contributor's forward here and on the servers beside us) and the lane only what they
leave.

On Linux a thread has its own nice value (setpriority on its thread id), and the threads it starts
(torch's OpenMP workers, for a pass of several threads) inherit it. Raising a thread's priority
again needs a privilege a volunteer's daemon lacks, so the lane is a thread of its own that stays
low for its whole life. Elsewhere (where nice is per process) there is no lane.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

LANE_NICE = 19  # the lowest priority: a nice-0 thread gets ~70 times its share of a contended core


def lanes_supported() -> bool:
    """Threads have nice values of their own here."""
    return sys.platform == "linux"


class LowPriorityLane:
    """One daemon thread at nice `nice` that runs the jobs given to `submit`, one at a time."""

    def __init__(self, nice: int = LANE_NICE, name: str = "peerd-takers-lane") -> None:
        self.nice = nice
        self.name = name
        self.niced: bool | None = None  # whether the thread got its nice value (None: not started)
        self.jobs_done = 0
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run job() in the lane (from any thread); it must not raise (a job that does is logged
        and dropped)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def _serve(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            self.niced = True
        except OSError as e:  # a sandbox that forbids it: the lane still frees the device
            log.info("the takers' lane runs at normal priority (setpriority failed: %s)", e)
            self.niced = False
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException:
                log.exception("a job in %s failed", self.name)
            self.jobs_done += 1
