"""How many CPU threads a forward through a span uses, chosen per pass by its size.

A decode step is one token per sequence: on some CPUs its matrix products are too small to
split, and a daemon pinned to one thread (`peerd start --torch-threads 1`, what a machine shared
with other daemons wants) loses nothing on it; on others (MKL's one-row path) two threads run
it 1.6x faster. A prompt's pass (prefill) is many tokens: its matrix
products split well, and the first token waits for it, so it wants every core the machine gives
the daemon. `ThreadPolicy` sets torch's thread count before each pass of at least
`prefill_rows` rows (batch x tokens) to `prefill`, and before smaller ones to `decode`.

torch's thread count is per OS thread where it matters (OpenMP's), so it is set in the thread
that runs the forward (the process's compute thread, peerd.node.compute_thread), and only when
it changes.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

# Rows from which a pass counts as prefill: a batch of 8 decode steps still runs as decode.
PREFILL_ROWS = 16


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class ThreadPolicy:
    """`decode` / `prefill`: torch threads for small / large passes; None leaves torch's count
    alone (its default: every core)."""

    decode: int | None = None
    prefill: int | None = None
    prefill_rows: int = PREFILL_ROWS

    def __post_init__(self) -> None:
        for name in ("decode", "prefill"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} threads must be >= 1 or None, got {value}")
        self._current = threading.local()

    def threads_for(self, rows: int) -> int | None:
        return self.prefill if rows >= self.prefill_rows else self.decode

    def apply(self, rows: int) -> None:
        """Set this thread's torch thread count for a pass of `rows` rows."""
        wanted = self.threads_for(rows)
        if wanted is not None and getattr(self._current, "threads", None) != wanted:
            torch.set_num_threads(wanted)
            self._current.threads = wanted


# The policy every span's forward follows; a daemon sets it from its flags (`configure`).
POLICY = ThreadPolicy()


def configure(decode: int | None, prefill: int | None = None) -> ThreadPolicy:
    """Use `decode` threads for small passes and `prefill` for large ones, process-wide (and
    `decode` in the calling thread from now on). `decode` None: torch's own count for both;
    `prefill` None: every core this process may use."""
    global POLICY
    if decode is None:
        POLICY = ThreadPolicy()
        return POLICY
    torch.set_num_threads(decode)
    POLICY = ThreadPolicy(decode, prefill or available_cores())
    return POLICY


def apply(rows: int) -> None:
    POLICY.apply(rows)
