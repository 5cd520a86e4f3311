"""The compute queue: inference first, and training that rests while inference is active."""

from __future__ import annotations

import threading
import time

import trio

from peerd.server.compute import (
    INFERENCE_ACTIVE_S,
    INLINE_MAX_S,
    MAX_REST,
    PRIORITY_INFERENCE,
    SLICE_S,
    ComputeQueue,
    training_rest,
)


def _busy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


async def test_training_slices_rest_while_inference_is_active_and_not_otherwise() -> None:
    queue = ComputeQueue()
    # Nobody generates: training runs back to back.
    for _ in range(3):
        await queue.training_slice(_busy, 0.01)
    assert queue.training_rested_s == 0.0
    # An inference step ran just now: each slice rests at least as long as it ran.
    await queue.run(PRIORITY_INFERENCE, _busy, 0.0)
    for _ in range(3):
        await queue.training_slice(_busy, 0.02)
    assert queue.training_rested_s >= 3 * 0.02
    rested = queue.training_rested_s
    # Once inference has been quiet for INFERENCE_ACTIVE_S, training has the device again.
    await trio.sleep(INFERENCE_ACTIVE_S)
    await queue.training_slice(_busy, 0.01)
    assert queue.training_rested_s == rested


async def test_an_inference_step_runs_while_a_training_slice_rests() -> None:
    """The rest holds the training lane, not the device: an inference step that comes during
    it runs at once, and the next training slice starts only when the rest is over."""
    queue = ComputeQueue()
    await queue.run(PRIORITY_INFERENCE, _busy, 0.0)
    started: list[str] = []
    first_done = threading.Event()

    def slice_of(name: str) -> None:
        started.append(name)
        time.sleep(0.5)
        if name == "train-1":
            first_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.training_slice, slice_of, "train-1")
        await trio.sleep(0.05)
        nursery.start_soon(queue.training_slice, slice_of, "train-2")
        await trio.to_thread.run_sync(first_done.wait)  # train-1 ran: its rest (0.5 s) begins
        await queue.run(PRIORITY_INFERENCE, started.append, "inference")
    assert started == ["train-1", "inference", "train-2"]


def test_a_long_slice_rests_longer_than_it_ran_so_the_wait_it_adds_stays_bounded() -> None:
    assert training_rest(SLICE_S / 2) == SLICE_S / 2  # a short slice: half of the device
    assert training_rest(SLICE_S) == SLICE_S
    # Four times SLICE_S: sixteen times SLICE_S of rest, a share of 1/5 of the device.
    assert training_rest(4 * SLICE_S) == 16 * SLICE_S
    for ran in (0.01, SLICE_S, 0.5, MAX_REST * SLICE_S):
        share = ran / (ran + training_rest(ran))
        assert share * ran / 2 <= SLICE_S / 2  # the mean wait of a step arriving at random
    # Training keeps a fifth of the device, however long its slices (its token cap counts on it).
    assert training_rest(30.0) == MAX_REST * 30.0


async def test_the_queue_rests_a_long_training_slice_by_its_square() -> None:
    queue = ComputeQueue()
    await queue.run(PRIORITY_INFERENCE, _busy, 0.0)
    await queue.training_slice(_busy, 2 * SLICE_S)  # ran at least 2 x SLICE_S
    assert queue.training_rested_s >= 4 * SLICE_S


async def test_a_step_that_waited_for_a_long_slice_makes_it_rest() -> None:
    """A slice longer than INFERENCE_ACTIVE_S (a 4096-token row on a loaded machine) outlasted
    the last step's time: no rest, and training ran back to back while steps waited. A step
    that came during the slice counts as inference being active."""
    queue = ComputeQueue()
    slice_started, release = threading.Event(), threading.Event()

    def long_slice() -> None:
        slice_started.set()
        release.wait(30)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.training_slice, long_slice)
        await trio.to_thread.run_sync(slice_started.wait)
        nursery.start_soon(queue.run, PRIORITY_INFERENCE, _busy, 0.0)  # waits for the slice
        await trio.sleep(0.01)
        release.set()
    assert queue.training_rested_s > 0


async def test_an_inline_job_runs_on_the_loop_when_the_device_is_free_and_waits_otherwise() -> None:
    queue = ComputeQueue()
    loop = threading.current_thread()
    # The first job offered inline runs in a worker thread (its time unknown); once timed short
    # and with the device free, the next runs here, on the event loop's thread.
    assert await queue.run(PRIORITY_INFERENCE, threading.current_thread, inline=True) is not loop
    assert await queue.run(PRIORITY_INFERENCE, threading.current_thread, inline=True) is loop
    ran_on: list[threading.Thread] = []

    def slow() -> None:
        time.sleep(0.05)

    async def inline_job() -> None:
        ran_on.append(await queue.run(PRIORITY_INFERENCE, threading.current_thread, inline=True))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run, PRIORITY_INFERENCE, slow)
        await trio.sleep(0.01)  # the slow job holds the device now
        nursery.start_soon(inline_job)
    # Busy: it waited its turn and ran in a worker thread, like any job.
    assert ran_on and ran_on[0] is not loop
    assert queue.jobs_done == 4 and queue.depth == 0
    # A job offered inline that took longer than INLINE_MAX_S sends the next to the thread.
    await queue.run(PRIORITY_INFERENCE, time.sleep, INLINE_MAX_S + 0.01, inline=True)
    assert await queue.run(PRIORITY_INFERENCE, threading.current_thread, inline=True) is not loop
