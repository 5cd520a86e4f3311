"""peerd.server.batching on a tiny random llama span: concurrent steps merge into one forward with
the
results each step gives alone; turns are fair between clients; one bad step fails alone."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing

import blocks
from peerd.devtools.localswarm import LocalSwarm, scrape_metrics
from peerd.server.batching import GATHER_MIN_S, INLINE_MAX_TOKENS, MERGE_MAX_TOKENS, StepBatcher
from peerd.server.compute import PRIORITY_INFERENCE, ComputeQueue
from peerd.session.leech import open_leech
from tests.conftest import greedy_continuation
from tests.tiny_models import save_tiny


@pytest.fixture(scope="module")
def span(tmp_path_factory: pytest.TempPathFactory) -> blocks.Span:
    path: Path = save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return blocks.load_span(path, 0, 3)


def _prefilled(span: blocks.Span, cache: blocks.MemoryCache, lengths: list[int]) -> list:
    sessions = []
    for i, length in enumerate(lengths):
        torch.manual_seed(i)
        session = cache.open_session(1, 64)
        span(torch.randn(1, length, 32), session)
        sessions.append(session)
    return sessions


@pytest.mark.parametrize("enabled", [True, False], ids=["batching", "one-by-one"])
async def test_concurrent_decode_steps_share_a_forward_and_match_each_alone(
    span: blocks.Span, enabled: bool
) -> None:
    cache = blocks.MemoryCache(budget_tokens=10_000)
    lengths = [3, 7, 1, 12, 5, 2]
    alone, merged = _prefilled(span, cache, lengths), _prefilled(span, cache, lengths)
    torch.manual_seed(9)
    steps = [torch.randn(1, 1, 32) for _ in lengths]
    want = [span(h, s) for h, s in zip(steps, alone, strict=True)]
    batcher = StepBatcher(ComputeQueue(), enabled=enabled)
    got: dict[int, torch.Tensor] = {}

    async def client(i: int) -> None:
        got[i] = await batcher.run(span, merged[i], steps[i], owner=f"peer{i}")

    async with trio.open_nursery() as nursery:
        for i in range(len(lengths)):
            nursery.start_soon(client, i)
    for i, w in enumerate(want):
        assert float((got[i] - w).abs().max()) <= 1e-5 * float(w.abs().max())
    assert [s.position for s in merged] == [n + 1 for n in lengths]
    assert batcher.counters.steps == len(lengths)
    if enabled:
        # The first step may start alone before the others arrive; the rest wait and merge.
        assert batcher.counters.forwards <= 2
        assert batcher.counters.merged_steps >= len(lengths) - 1
    else:
        assert batcher.counters.forwards == len(lengths)
        assert batcher.counters.merged_steps == 0


async def test_a_long_prefill_takes_turns_with_other_clients_decode_steps(
    span: blocks.Span,
) -> None:
    """A long prompt runs a chunk per turn: another client's decode steps go between its chunks
    instead of waiting for the whole prefill."""
    cache = blocks.MemoryCache(budget_tokens=10_000)
    prompt = torch.randn(1, 8 * 8, 32)
    assert prompt.shape[1] > MERGE_MAX_TOKENS
    heavy, light = cache.open_session(1, 80), _prefilled(span, cache, [4])[0]
    with cache.open_session(1, 80) as reference:
        want = span(prompt, reference)
    batcher = StepBatcher(ComputeQueue())
    events: list[str] = []
    span.chunk_tokens = 8

    async def heavy_client() -> None:
        got = await batcher.run(span, heavy, prompt, owner="heavy")
        events.append("prefill done")
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())

    async def light_client() -> None:
        await trio.sleep(0)  # let the prefill take the first turn
        for _ in range(3):
            await batcher.run(span, light, torch.randn(1, 1, 32), owner="light")
            events.append("decode")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heavy_client)
            nursery.start_soon(light_client)
    finally:
        span.chunk_tokens = blocks.span.PREFILL_CHUNK_TOKENS
    assert events == ["decode", "decode", "decode", "prefill done"]
    assert heavy.position == 64 and light.position == 7


async def test_a_bad_step_fails_alone_and_the_others_go_on(span: blocks.Span) -> None:
    cache = blocks.MemoryCache(budget_tokens=10_000)
    good = _prefilled(span, cache, [3, 4])
    closed = _prefilled(span, cache, [2])[0]
    closed.close()
    batcher = StepBatcher(ComputeQueue())
    results: dict[str, object] = {}

    async def client(name: str, session: blocks.SpanSession) -> None:
        try:
            results[name] = await batcher.run(span, session, torch.randn(1, 1, 32), owner=name)
        except blocks.BlocksError as e:
            results[name] = e

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client, "a", good[0])
        nursery.start_soon(client, "bad", closed)
        nursery.start_soon(client, "b", good[1])
    assert isinstance(results["bad"], blocks.BlocksError)
    assert "closed" in str(results["bad"])
    assert isinstance(results["a"], torch.Tensor) and isinstance(results["b"], torch.Tensor)
    assert [s.position for s in good] == [4, 5]


async def test_steps_that_ran_together_wait_for_each_other_and_strangers_do_not(
    span: blocks.Span,
) -> None:
    """Once merged, a group of sessions whose next steps come back a few ms apart (as a previous
    server pushes them one by one) runs as one forward again; a session that never ran with
    them does not wait for them."""
    cache = blocks.MemoryCache(budget_tokens=10_000)
    group = _prefilled(span, cache, [3, 4, 5, 6])
    batcher = StepBatcher(ComputeQueue())

    async def step(i: int, delay: float) -> None:
        await trio.sleep(delay)
        await batcher.run(span, group[i], torch.randn(1, 1, 32), owner=f"peer{i}")

    async def rounds(count: int, spread: float) -> list[int]:
        forwards = []
        for _ in range(count):
            before = batcher.counters.forwards
            async with trio.open_nursery() as nursery:
                for i in range(len(group)):
                    nursery.start_soon(step, i, i * spread)
            forwards.append(batcher.counters.forwards - before)
            await trio.sleep(0.1)  # the sessions step every ~100 ms: they may wait ~25 ms
        return forwards

    assert (await rounds(1, 0.0))[0] <= 2  # arrive together: merged (the first may go alone)
    # Now they arrive 5 ms apart, the last 15 ms after the first: still one forward each round.
    assert await rounds(4, 0.005) == [1, 1, 1, 1]

    stranger = _prefilled(span, cache, [2])[0]
    began = trio.current_time()
    await batcher.run(span, stranger, torch.randn(1, 1, 32), owner="stranger")
    assert trio.current_time() - began < GATHER_MIN_S + 0.05  # no cohort: it did not wait


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_pushed_steps_of_concurrent_sessions_merge_on_the_next_server(
    local_model: Any, tokenizer: Any
) -> None:
    """The second server gets its steps only pushed by the first, all on one push stream: it
    must run them concurrently (merged into shared forwards), and every session still gets the
    text it gets alone."""
    swarm = LocalSwarm()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Red, green"]
    new_tokens = 6  # 4 sessions of 6 steps: 18 of the 24 merged in a run here
    try:
        swarm.start("a", "0:15")
        second = swarm.start("b", "15:30", "--metrics-port", "0")
        port = second.metrics_port()
        async with open_leech("default", swarm.initial_peers) as leech:
            texts: dict[str, str] = {}

            async def generate(prompt: str) -> None:
                ids = leech.client.tokenizer(prompt, return_tensors="pt")["input_ids"]
                tokens = [int(t[0, 0]) async for t in leech.generator.generate(ids, new_tokens)]
                texts[prompt] = leech.client.tokenizer.decode(tokens)

            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(generate, prompt)
        metrics = scrape_metrics(port)
        print(f"second server: {metrics['peerd_steps_total']:.0f} steps in "
              f"{metrics['peerd_forwards_total']:.0f} forwards, "
              f"{metrics['peerd_merged_steps_total']:.0f} of them merged")  # fmt: skip
        # 0 if run one by one
        assert metrics["peerd_merged_steps_total"] >= len(prompts) * new_tokens // 4
        assert metrics["peerd_forwards_total"] < metrics["peerd_steps_total"]
        for prompt in prompts:
            want = greedy_continuation(local_model, tokenizer, prompt, new_tokens)
            assert texts[prompt] == tokenizer.decode(want), prompt
    finally:
        swarm.stop()


async def test_speculative_passes_merge_and_roll_back_like_any_steps(span: blocks.Span) -> None:
    """A speculative pass is a multi-token step (the pending token and k drafts, at most
    MERGE_MAX_TOKENS): concurrent passes of several sessions merge into one forward with each
    one's own result, and after each session rolls back to the drafts that stood (as the next
    step's start position makes a server do), the next passes merge again and still give what
    the same steps give run alone."""
    cache = blocks.MemoryCache(budget_tokens=10_000)
    lengths = [3, 7, 12, 5]
    drafts = [4, 2, 8, 6]
    stood = [1, 2, 0, 6]
    assert max(drafts) + 1 <= MERGE_MAX_TOKENS
    alone, merged = _prefilled(span, cache, lengths), _prefilled(span, cache, lengths)
    batcher = StepBatcher(ComputeQueue())
    torch.manual_seed(11)
    for _ in range(2):
        starts = [s.position for s in merged]
        steps = [torch.randn(1, k + 1, 32) for k in drafts]
        want = [span(h, s) for h, s in zip(steps, alone, strict=True)]
        got: dict[int, torch.Tensor] = {}
        forwards, merged_steps = batcher.counters.forwards, batcher.counters.merged_steps

        async def client(i: int, step: torch.Tensor, out: dict[int, torch.Tensor]) -> None:
            out[i] = await batcher.run(span, merged[i], step, owner=f"peer{i}")

        async with trio.open_nursery() as nursery:
            for i in range(len(lengths)):
                nursery.start_soon(client, i, steps[i], got)
        for i, w in enumerate(want):
            assert float((got[i] - w).abs().max()) <= 1e-5 * float(w.abs().max())
        # The first pass may start alone before the others arrive; the rest wait and merge.
        assert batcher.counters.forwards - forwards <= 2
        assert batcher.counters.merged_steps - merged_steps >= len(lengths) - 1
        for i, start in enumerate(starts):
            for session in (alone[i], merged[i]):
                assert session.position == start + drafts[i] + 1
                session.rollback(start + 1 + stood[i])


async def test_a_lone_sessions_short_steps_run_on_the_loop_and_shared_or_long_ones_do_not(
    span: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    loop = threading.current_thread()
    threads: list[bool] = []  # per forward: ran on the loop's thread
    forward = blocks.Span.forward

    def recording(self: blocks.Span, *args: Any, **kwargs: Any) -> torch.Tensor:
        threads.append(threading.current_thread() is loop)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(blocks.Span, "forward", recording)
    # The rules, not the clock: however loaded the machine, a forward counts as short and a
    # session that stepped counts as active.
    monkeypatch.setattr("peerd.server.compute.INLINE_MAX_S", 60.0)
    monkeypatch.setattr("peerd.server.batching.ACTIVE_S", 600.0)
    # Decode passes on one torch thread (--torch-threads 1): only those may run on the loop.
    monkeypatch.setattr(blocks.threads, "POLICY", blocks.threads.ThreadPolicy(decode=1))
    cache = blocks.MemoryCache(budget_tokens=10_000)
    lone, other = _prefilled(span, cache, [4, 4])
    want = [
        span(torch.full((1, 1, 32), 0.1 * i), s)
        for i, s in enumerate(_prefilled(span, cache, [4]) * 3)
    ]
    batcher = StepBatcher(ComputeQueue())
    threads.clear()
    got = [await batcher.run(span, lone, torch.full((1, 1, 32), 0.1 * i), "a") for i in range(3)]
    # The first short step runs on the compute thread (nothing timed yet); then on the loop.
    assert threads == [False, True, True]
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())
    # A step longer than INLINE_MAX_TOKENS goes to the compute thread.
    await batcher.run(span, lone, torch.randn(1, INLINE_MAX_TOKENS + 1, 32), "a")
    assert threads[-1] is False
    # Another peer's session stepped just now: steps are the batcher's to merge, in the thread.
    await batcher.run(span, other, torch.randn(1, 1, 32), "b")
    await batcher.run(span, lone, torch.randn(1, 1, 32), "a")
    assert threads[-2:] == [False, False]
    # Decode on two threads: never on the loop, whose own OpenMP team would slow every pass.
    monkeypatch.setattr(blocks.threads, "POLICY", blocks.threads.ThreadPolicy(decode=2))
    fresh = StepBatcher(ComputeQueue())
    for _ in range(3):
        await fresh.run(span, lone, torch.randn(1, 1, 32), "a")
    assert threads[-3:] == [False, False, False]


@pytest.mark.parametrize(
    ("owners", "groups", "merged"),
    [
        (["me", "me", "me", "me"], [0, 1, 0, 1], False),  # one client's two micro-batches
        (["me", "me", "me", "me"], [0, 0, 0, 0], True),
        (["me", "me", "me", "me"], [None, 1, None, 1], True),  # ungrouped steps merge with any
        (["p0", "p1", "p2", "p3"], [0, 1, 0, 1], True),  # other clients' groups are no bar
    ],
)
async def test_one_clients_micro_batches_run_apart_and_others_merge(
    span: blocks.Span, owners: list[str], groups: list[int | None], merged: bool
) -> None:
    cache = blocks.MemoryCache(budget_tokens=10_000)
    sessions = _prefilled(span, cache, [3, 5, 2, 4])
    batcher = StepBatcher(ComputeQueue())
    forwards: list[int] = []
    forward_batch = span.forward_batch

    def counted(steps: Any, adapter: str | None = None) -> list[torch.Tensor]:
        forwards.append(len(steps))
        return forward_batch(steps, adapter)

    async def step(i: int) -> None:
        hidden = torch.randn(1, 1, 32)
        await batcher.run(span, sessions[i], hidden, owners[i], micro_batch=groups[i])

    busy = threading.Event()
    span.forward_batch = counted  # type: ignore[method-assign]
    try:
        # Queued together behind a busy device, as a group's steps are while another one's run.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.compute.run, PRIORITY_INFERENCE, busy.wait)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(4):
                nursery.start_soon(step, i)
            await trio.testing.wait_all_tasks_blocked()
            busy.set()
    finally:
        del span.forward_batch
    if merged:
        assert forwards == [4]
    else:
        assert sorted(forwards) == [2, 2]
