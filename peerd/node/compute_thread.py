"""The process's compute thread: every torch pass of a daemon (its span's forwards, the LM head
of its generations, loading and tuning a span) runs on this one OS thread.

Why one thread and not trio's thread cache or the event loop: torch's CPU kernels run on OpenMP
(GNU libgomp in the PyPI builds), which gives each OS thread that starts a parallel region a team
of worker threads of its own, kept while that thread lives. Once two live threads each have a
team, the process has more OpenMP threads than cores, and libgomp stops spinning between regions:
every region then wakes its workers through the kernel. A forward is hundreds of small regions,
so on a 2-core machine a 1-row product of the default model's MLP took 140 us instead of 35
(docs/swarm.md, "One compute thread"), and a daemon that ran its short steps on the event loop
and the rest on a worker thread computed at the pace of one core on two. With every pass on one
thread there is one team, and the event loop's own small tensor work stays on one thread
(`quiet_event_loop_thread`).

`run` is awaited from trio like `trio.to_thread.run_sync` (in the caller's context variables; not
cancellable while it runs: the caller gets the result or the error once the job is done); jobs
run one at a time in the order they were handed over.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import outcome
import torch
import trio

T = TypeVar("T")

_Job = Callable[[], None]


class ComputeThread:
    """One long-lived worker thread that runs the jobs handed to it, in order."""

    def __init__(self, name: str = "peerd-compute") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @property
    def ident(self) -> int | None:
        """The OS thread's id once started (tests check where a pass ran)."""
        return self._thread.ident if self._thread is not None else None

    def _started(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the compute thread; its result, or its exception raised here."""
        self._started()
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        context = contextvars.copy_context()  # the caller's context vars, as to_thread's

        def job() -> None:
            result = outcome.capture(context.run, fn, *args)
            # The caller's event loop may be gone: then there is nobody to tell.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self._jobs.put(job)

        def abort(_: object) -> trio.lowlevel.Abort:
            return trio.lowlevel.Abort.FAILED  # the job runs to its end, as to_thread's does

        result: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return result


COMPUTE_THREAD = ComputeThread()
"""The one every part of a daemon uses: the server's compute queue, the generator's LM head."""


async def run(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) on the process's compute thread (COMPUTE_THREAD)."""
    return await COMPUTE_THREAD.run(fn, *args)


def quiet_event_loop_thread() -> None:
    """Keep torch on the calling thread (the event loop's) to one thread: the small tensor work
    it does itself (decoding frames, copying a step's rows) then never starts an OpenMP team of
    its own beside the compute thread's."""
    torch.set_num_threads(1)
