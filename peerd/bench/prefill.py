"""`peerd bench prefill`: the time to the first token of a long prompt through local daemons, the
prompt whole against pipelined in chunks (peerd.session.steps.pipeline_chunks), in the same run.

Chunks pay where each server computes on hardware of its own. Two daemons (15/15 blocks of the
default model) each pinned to a core of their own, one torch thread each, stand for two machines
(they still share the host's memory and L3); `speedup` is the prompt whole over pipelined, the
medians over `runs` alternating repetitions. `colocated_speedup` is the same for three daemons
left to share every core (2 threads each, as `bench swarm` runs them): what `pipeline` auto
(None) avoids by leaving a route whole when its servers share a host.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import trio

import blocks
from peerd.bench.swarm import PROMPT
from peerd.devtools.localswarm import LocalSwarm
from peerd.node import compute_thread
from peerd.session.inference import InferenceSession
from peerd.session.leech import Leech, open_leech
from peerd.session.steps import pipeline_chunks


def pin(pid: int, cpu: int) -> None:
    """Every thread of process `pid` on core `cpu` (the threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


async def _first_token(
    leech: Leech, ids: torch.Tensor, pipeline: bool, new_tokens: int
) -> tuple[float, list[int]]:
    """(seconds from opening a session to the first token, the `new_tokens` greedy tokens: the
    ones after the first tell whether the servers' caches hold the whole prompt)."""
    tokens: list[int] = []
    started = time.perf_counter()
    first_s = 0.0
    async with InferenceSession(
        leech.swarm,
        max_length=ids.shape[1] + new_tokens,
        open_with_first_step=True,
        pipeline=pipeline,
    ) as session:
        async for token in leech.generator.generate(ids, new_tokens, session=session):
            tokens.append(int(token[0, 0]))
            if len(tokens) == 1:
                first_s = time.perf_counter() - started
    return first_s, tokens


def _measure(swarm: LocalSwarm, ids: torch.Tensor, runs: int, new_tokens: int) -> dict[str, Any]:
    """Alternating runs of the prompt whole and pipelined through `swarm`."""

    async def main() -> dict[str, Any]:
        async with open_leech("default", swarm.initial_peers, refresh_period=30.0) as leech:
            for pipeline in (False, True):  # warm-up: connections, first allocations
                await _first_token(leech, ids, pipeline, 2)
            whole: list[float] = []
            piped: list[float] = []
            tokens: set[tuple[int, ...]] = set()
            for _ in range(runs):
                for pipeline, times in ((False, whole), (True, piped)):
                    seconds, generated = await _first_token(leech, ids, pipeline, new_tokens)
                    times.append(seconds)
                    tokens.add(tuple(generated))
            route = leech.swarm.plan()
        return {
            "ttft_whole_s": statistics.median(whole),
            "ttft_pipelined_s": statistics.median(piped),
            "speedup": statistics.median(whole) / statistics.median(piped),
            "chunks": pipeline_chunks(int(ids.shape[1]), route, True),
            "same_tokens": len(tokens) == 1,
            "all_whole_s": whole,
            "all_pipelined_s": piped,
        }

    return trio.run(main)


def _swarm(spans: list[str], threads: int, pinned: bool) -> LocalSwarm:
    swarm = LocalSwarm(refresh_period=30.0, torch_threads=threads, throughput="auto")
    cores = sorted(os.sched_getaffinity(0))  # the cores we may use, not always 0 and 1
    try:
        for i, span in enumerate(spans):
            daemon = swarm.start(f"d{i}", span, "--prefill-threads", str(threads), online=True)
            if pinned:
                assert daemon.process is not None
                pin(daemon.process.pid, cores[i % len(cores)])
    except BaseException:
        swarm.stop()  # the daemons started so far
        raise
    return swarm


def run_prefill_bench(
    runs: int = 5, repeat: int = 3, colocated: bool = True, new_tokens: int = 4
) -> dict[str, Any]:
    """`repeat`: the prompt is bench swarm's (84 tokens) that many times over; `new_tokens`:
    greedy tokens of each generation, the same whole and pipelined (`same_tokens`)."""
    if len(os.sched_getaffinity(0)) < 2:
        raise ValueError("needs two cores to pin two daemons apart")
    blocks.threads.configure(2, 2)
    compute_thread.quiet_event_loop_thread()
    client = blocks.load_client_side(blocks.resolve_checkpoint("default"))
    ids = client.tokenizer(PROMPT * repeat, return_tensors="pt")["input_ids"]
    report: dict[str, Any] = {"prompt_tokens": int(ids.shape[1]), "runs": runs}
    report["new_tokens"] = new_tokens
    swarm = _swarm(["0:15", "15:30"], 1, pinned=True)
    try:
        report.update(_measure(swarm, ids, runs, new_tokens))
    finally:
        swarm.stop()
    if colocated:
        swarm = _swarm(["0:10", "10:20", "20:30"], 2, pinned=False)
        try:
            shared = _measure(swarm, ids, runs, new_tokens)
        finally:
            swarm.stop()
        report.update(
            colocated_speedup=shared["speedup"],
            colocated_ttft_whole_s=shared["ttft_whole_s"],
            colocated_ttft_pipelined_s=shared["ttft_pipelined_s"],
            colocated_same_tokens=shared["same_tokens"],
        )
    return report
