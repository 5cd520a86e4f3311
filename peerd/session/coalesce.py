"""Concurrent calls whose work is cheaper done together run as one batch in a worker thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)
class _Call(Generic[T, R]):
    item: T
    result: R | None = None
    error: Exception | None = None
    finished: bool = False


class Coalescer(Generic[T, R]):
    """Concurrent calls whose work is cheaper done together: calls that arrive while a batch runs
    (in a worker thread) wait, then go together in the next. `run_batch(items)` returns one
    result per item; an exception it raises fails every call of that batch.

    For work bound by reading weights, like the LM head of many sessions' next tokens: one
    matrix product over all their rows reads the weights once."""

    def __init__(self, run_batch: Callable[[list[T]], list[R]]) -> None:
        self._run_batch = run_batch
        self._pending: list[_Call[T, R]] = []
        self._running = False
        self._batch_over = trio.Event()
        self.batches = 0

    async def __call__(self, item: T) -> R:
        call: _Call[T, R] = _Call(item)
        self._pending.append(call)
        try:
            while not call.finished:
                if self._running:
                    await self._batch_over.wait()
                    continue
                batch, self._pending = self._pending, []
                self._running = True
                try:
                    results = await trio.to_thread.run_sync(
                        self._run_batch, [c.item for c in batch]
                    )
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
        finally:
            if call in self._pending:
                self._pending.remove(call)
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]
