"""The process's compute thread: one OS thread for every torch pass, awaited from trio."""

from __future__ import annotations

import threading

import pytest
import trio

from peerd.node.compute_thread import ComputeThread


async def test_jobs_run_in_order_on_one_thread_that_is_not_the_event_loop() -> None:
    thread = ComputeThread(name="test-compute")
    seen: list[tuple[int, int]] = []

    def job(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    async with trio.open_nursery() as nursery:
        results: dict[int, int] = {}

        async def one(i: int) -> None:
            results[i] = await thread.run(job, i)

        for i in range(20):
            nursery.start_soon(one, i)
    assert results == {i: i * i for i in range(20)}
    assert {ident for _, ident in seen} == {thread.ident}
    assert thread.ident != threading.get_ident()
    assert sorted(i for i, _ in seen) == list(range(20))


async def test_an_error_reaches_the_caller_and_the_thread_goes_on() -> None:
    thread = ComputeThread(name="test-compute")

    def fail() -> None:
        raise ValueError("bad pass")

    with pytest.raises(ValueError, match="bad pass"):
        await thread.run(fail)
    assert await thread.run(lambda: 7) == 7


async def test_a_cancelled_caller_waits_for_its_job_to_end() -> None:
    """As trio.to_thread.run_sync: a job under way is not abandoned, so nothing it holds (the
    device, a session's cache) is used by the next job while it still runs."""
    thread = ComputeThread(name="test-compute")
    finished = threading.Event()
    got: list[str] = []

    def slow() -> str:
        threading.Event().wait(0.3)
        finished.set()
        return "done"

    with trio.move_on_after(0.05) as scope:
        got.append(await thread.run(slow))
        await trio.sleep(1)  # the cancellation lands here, after the job
    assert scope.cancelled_caught
    assert got == ["done"] and finished.is_set()


async def test_a_leech_loads_its_client_side_on_the_compute_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading (the LM head's tuning passes) on any other thread would give that thread an
    OpenMP team beside the compute thread's: a 10-block prefill then took 0.07 s instead of
    0.05 on the compute thread while that thread lived."""
    import blocks
    from peerd.node import compute_thread
    from peerd.session.leech import open_leech

    loaded_on: list[int] = []

    class Loaded(Exception):
        pass

    def load_client_side(checkpoint: str) -> None:
        loaded_on.append(threading.get_ident())
        raise Loaded(checkpoint)

    monkeypatch.setattr(blocks, "resolve_checkpoint", lambda model: f"checkpoint of {model}")
    monkeypatch.setattr(blocks, "load_client_side", load_client_side)
    with pytest.raises(Loaded, match="checkpoint of default"):
        async with open_leech("default", []):
            pass
    assert loaded_on == [compute_thread.COMPUTE_THREAD.ident]
