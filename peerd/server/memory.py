"""Giving the memory of training work back to the system.

A training request of a few thousand tokens decodes to tens of MB of tensors and its slices make
hundreds of MB of activations, all freed when the request is answered; but glibc keeps freed
blocks below its (self-raising) mmap threshold in its heaps, one per thread that allocated them,
so a server that once ran a flood of training requests kept ~300 MB more resident for good.
`MemoryTrim` hands that back (malloc_trim) after training work, at most once every TRIM_EVERY_S,
in a worker thread (trimming a few hundred MB takes tens of ms) and never on an inference step's
path. Where the C library has no malloc_trim (not glibc), trimming does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable

import trio

# The least time between two trims: a trim walks every heap, and training work frees memory
# every slice.
TRIM_EVERY_S = 1.0


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0), or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class MemoryTrim:
    """Trims the C heap after work that freed large buffers (`freed`), at most once every
    `every_s`; `trim` is the system call (glibc's malloc_trim by default; None: nothing)."""

    def __init__(
        self, every_s: float = TRIM_EVERY_S, trim: Callable[[], object] | None = None
    ) -> None:
        self.every_s = every_s
        self._trim = trim if trim is not None else _malloc_trim()
        self._due = False
        self._last = -math.inf
        self.trims = 0

    def freed(self) -> None:
        """Large buffers were freed (a training slice ran, a request was answered or refused)."""
        self._due = True

    def take(self, now: float, last_work: bool = False) -> bool:
        """Whether to trim now: memory was freed since the last trim, and that was at least
        every_s ago or this was the `last_work` for a while (nothing else would trim)."""
        if not self._due or self._trim is None:
            return False
        if now - self._last < self.every_s and not last_work:
            return False
        self._due, self._last = False, now
        return True

    def trim(self) -> None:
        """Trim now, in this thread (a worker thread: it may take tens of ms)."""
        if self._trim is not None:
            self._trim()
            self.trims += 1

    async def after_work(self, last_work: bool = False) -> None:
        """Note that work freed memory, and trim in a worker thread if one is due (always when
        this was the `last_work`: no training left queued or running)."""
        self.freed()
        if self.take(trio.current_time(), last_work):
            await trio.to_thread.run_sync(self.trim)
