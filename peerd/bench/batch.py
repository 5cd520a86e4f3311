"""`peerd bench batch`: aggregate decode tokens/s of 8 concurrent sessions over that of one
session, on three local daemons (10/10/10 blocks of the default model) that merge concurrent
steps into one forward, beside three daemons started with --no-batching, in the same run.

Sessions are what a program using this daemon's swarm runs: in-process leech sessions, each its
own InferenceSession with its own prompt, greedy, all stepping at once. Decode tokens/s counts
tokens sampled while every session of a round was decoding (from the last first token to the
first last token), so prefills and stragglers do not dilute it. The clients' own work (embedding,
LM head, sampling, wire encoding of 8 sessions) runs on the same two cores as the daemons:
that is real use on one machine, and it caps the figure. Rounds alternate between the two
swarms; medians over `runs` rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import trio

from peerd.devtools.localswarm import LocalSwarm
from peerd.session.inference import InferenceSession
from peerd.session.leech import Leech, open_leech

SPANS = ("0:10", "10:20", "20:30")
PROMPTS = (
    "Once upon a time, there was a little",
    "The capital of France is",
    "def fibonacci(n):",
    "In a hole in the ground there lived",
    "The three primary colours are",
    "Photosynthesis is the process by which plants",
    "My favourite recipe for a rainy Sunday afternoon starts with",
    "The most important thing about writing good software is",
)


async def _session(leech: Leech, prompt: str, new_tokens: int) -> tuple[list[float], list[int]]:
    """(when each token arrived, the tokens) of one greedy generation in a session of its own."""
    ids = leech.client.tokenizer(prompt, return_tensors="pt")["input_ids"]
    times: list[float] = []
    tokens: list[int] = []
    async with InferenceSession(
        leech.swarm, max_length=ids.shape[1] + new_tokens, open_with_first_step=True
    ) as session:
        async for token in leech.generator.generate(ids, new_tokens, session=session):
            times.append(time.perf_counter())
            tokens.append(int(token[0, 0]))
    return times, tokens


async def _round(leech: Leech, sessions: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    """(aggregate decode tokens/s, each session's tokens) of `sessions` concurrent sessions."""
    results: list[tuple[list[float], list[int]]] = [([], [])] * sessions

    async def one(i: int) -> None:
        results[i] = await _session(leech, PROMPTS[i % len(PROMPTS)], new_tokens)

    async with trio.open_nursery() as nursery:
        for i in range(sessions):
            nursery.start_soon(one, i)
    begin = max(times[0] for times, _ in results)
    end = min(times[-1] for times, _ in results)
    if end <= begin:  # a session finished before another started decoding: not concurrent
        raise RuntimeError("the sessions did not overlap; use more new_tokens")
    decoded = sum(sum(begin < t <= end for t in times) for times, _ in results)
    return decoded / (end - begin), [tokens for _, tokens in results]


def _start_swarm(*extra: str) -> LocalSwarm:
    # One torch thread per daemon: the threads of six daemons would crowd two cores (8-row
    # forwards on two threads made fewer tokens/s here, not more: docs/swarm.md).
    swarm = LocalSwarm(refresh_period=30.0, torch_threads=1)
    for name, span in zip("abc", SPANS, strict=True):
        swarm.start(name, span, *extra, online=True)
    return swarm


def run_batch_bench(
    runs: int = 3, sessions: int = 8, new_tokens: int = 32, torch_threads: int = 1
) -> dict[str, Any]:
    torch.set_num_threads(torch_threads)
    swarms = {"batching": _start_swarm(), "no_batching": _start_swarm("--no-batching")}
    try:

        async def measure() -> dict[str, Any]:
            rows: list[dict[str, float]] = []
            same = True
            async with (
                open_leech("default", swarms["batching"].initial_peers) as on,
                open_leech("default", swarms["no_batching"].initial_peers) as off,
            ):
                for leech in (on, off):  # warm-up: connections, first allocations
                    await _round(leech, 2, 4)
                for _ in range(runs):
                    single, _ = await _round(on, 1, new_tokens)
                    single_off, _ = await _round(off, 1, new_tokens)
                    many, tokens = await _round(on, sessions, new_tokens)
                    many_off, tokens_off = await _round(off, sessions, new_tokens)
                    same &= tokens == tokens_off
                    rows.append(
                        {
                            "speedup": many / single,
                            "speedup_no_batching": many_off / single_off,
                            "batching_gain": many / many_off,
                            "single_decode_tps": single,
                            "aggregate_decode_tps": many,
                            "single_decode_tps_no_batching": single_off,
                            "aggregate_decode_tps_no_batching": many_off,
                        }
                    )
            report: dict[str, Any] = {
                key: round(statistics.median(row[key] for row in rows), 3) for key in rows[0]
            }
            report.update(
                runs=runs,
                sessions=sessions,
                new_tokens=new_tokens,
                same_tokens_with_and_without_batching=same,
                all_speedups=[round(row["speedup"], 3) for row in rows],
                all_speedups_no_batching=[round(row["speedup_no_batching"], 3) for row in rows],
            )
            return report

        return trio.run(measure)
    finally:
        for swarm in swarms.values():
            swarm.stop()
