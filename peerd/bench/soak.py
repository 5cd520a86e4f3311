"""`peerd bench soak`: clients generate without pause for a bounded time while servers are
killed (kill -9) and restarted on a schedule; the swarm must hold.

Layout: every span of the model is served twice. One server per span lives the whole run; the
other (the "victim", announcing more throughput so routes prefer it and every kill lands on
generations in flight) is killed every `kill_every_s`, alternating between spans, and restarted
at once with the same identity, so some server always holds every block. The clients talk to
one client daemon (`peerd start --blocks none`) over its socket, as `peerd generate` does.

Reported: generations completed and failed (an error reached the client), and mismatched (greedy
text differing from the same prompt's text before any kill); token latency p50/p95 (time between
consecutive tokens of a generation, the failovers included) and time to first token; RSS of the
daemons that live the whole run (the client daemon and the long-lived servers) at the start,
after `warmup_s` and at the end, and `rss_growth`: the largest (end - warm) / warm among them.
"""

from __future__ import annotations

import functools
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil
import trio

import wire
from peerd.devtools.localswarm import DaemonProcess, LocalSwarm
from peerd.sdk.client import AsyncClient, PeerdError

PROMPTS = (
    "Once upon a time, there was a little",
    "The capital of France is",
    "Here is a short list of fruits: apples,",
    "The best way to learn a new language is",
)
# The victims announce this much, the long-lived servers LocalSwarm's default (20 tokens/s):
# routes then prefer the victims.
VICTIM_THROUGHPUT = "40"
# A generation still running this long after the end is cut off (and counted as failed).
GRACE_S = 120.0


@dataclass
class _Stats:
    completed: int = 0
    failed: int = 0
    mismatched: int = 0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    duration: float = 0.0


def _rss_mb(daemon: DaemonProcess) -> float:
    assert daemon.process is not None
    return psutil.Process(daemon.process.pid).memory_info().rss / 2**20


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


async def _generate(
    socket: Any,
    prompt: str,
    new_tokens: int,
    stats: _Stats | None,
    blocked_servers: tuple[str, ...] = (),
) -> list[int]:
    """Greedy token ids of one generation through the client daemon, timing each token."""
    ids: list[int] = []
    async with AsyncClient(socket, blocked_servers=blocked_servers) as client:
        started = last = trio.current_time()
        async for message in client.stream_tokens(prompt, max_new_tokens=new_tokens):
            if not isinstance(message, wire.GeneratedToken):
                continue
            now = trio.current_time()
            if stats is not None:
                (stats.gaps if ids else stats.first_token).append(now - (last if ids else started))
            last = now
            ids.append(message.token_id)
    return ids


async def _client(
    number: int,
    socket: Any,
    references: list[list[int]],
    new_tokens: int,
    deadline: float,
    stats: _Stats,
) -> None:
    turn = number
    while trio.current_time() < deadline:
        which = turn % len(PROMPTS)
        turn += 1
        try:
            with trio.fail_after(deadline - trio.current_time() + GRACE_S):
                ids = await _generate(socket, PROMPTS[which], new_tokens, stats)
        except (PeerdError, trio.TooSlowError, OSError) as e:
            stats.failed += 1
            stats.errors.append(f"client {number}: {type(e).__name__}: {e}"[:300])
            continue
        stats.completed += 1
        stats.tokens += len(ids)
        if ids != references[which]:
            stats.mismatched += 1


async def _killer(
    swarm: LocalSwarm,
    victims: list[tuple[DaemonProcess, str]],
    every: float,
    deadline: float,
    stats: _Stats,
) -> None:
    """Every `every` seconds kill the next victim that is up (in turn) and restart it at once
    with the same identity, in the background: a slow restart does not delay the next kill."""
    turn = 0
    restarting: set[int] = set()

    async def restart(index: int, name: str) -> None:
        daemon, span = victims[index]
        identity = daemon.identity.stem
        start = functools.partial(
            swarm.start, name, span, "--throughput", VICTIM_THROUGHPUT, identity=identity
        )
        try:
            victims[index] = (await trio.to_thread.run_sync(start), span)
        finally:
            restarting.discard(index)

    async with trio.open_nursery() as nursery:
        next_kill = trio.current_time() + every
        while next_kill < deadline:
            await trio.sleep_until(next_kill)
            at = next_kill
            next_kill += every
            up = [i for i in range(len(victims)) if i not in restarting]
            if not up:
                stats.kills.append(
                    f"none at {at - deadline + stats.duration:.0f} s (all restarting)"
                )
                continue
            index = min(up, key=lambda i: (i - turn) % len(victims))
            turn = index + 1
            daemon, span = victims[index]
            await trio.to_thread.run_sync(daemon.kill)
            stats.kills.append(f"{daemon.name} ({span}) at {at - deadline + stats.duration:.0f} s")
            restarting.add(index)
            nursery.start_soon(restart, index, f"{daemon.identity.stem}-{len(stats.kills)}")


async def _reference_answers(
    client: DaemonProcess,
    victims: list[tuple[DaemonProcess, str]],
    new_tokens: int,
    stats: _Stats,
) -> list[list[int]]:
    """The honest answer of every prompt, before anything is killed, from the long-lived servers
    (routes prefer the victims, so those would otherwise first serve when a victim dies, after
    the warm-up: their first sessions' allocations would count as growth). Then once through
    the victims, which must give the same text (a difference counts as mismatched)."""
    victim_ids = tuple(daemon.peer_id for daemon, _ in victims)
    references = [await _generate(client.socket, p, new_tokens, None, victim_ids) for p in PROMPTS]
    for prompt, reference in zip(PROMPTS, references, strict=True):
        if await _generate(client.socket, prompt, new_tokens, None) != reference:
            stats.mismatched += 1
    return references


async def _soak(
    swarm: LocalSwarm,
    client: DaemonProcess,
    long_lived: list[DaemonProcess],
    victims: list[tuple[DaemonProcess, str]],
    *,
    duration_s: float,
    clients: int,
    kill_every_s: float,
    new_tokens: int,
    warmup_s: float,
) -> dict[str, Any]:
    stats = _Stats(duration=duration_s)
    references = await _reference_answers(client, victims, new_tokens, stats)
    rss_start = {d.name: _rss_mb(d) for d in long_lived}
    started = trio.current_time()
    deadline = started + duration_s
    rss_warm: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        for number in range(clients):
            nursery.start_soon(
                _client, number, client.socket, references, new_tokens, deadline, stats
            )
        nursery.start_soon(_killer, swarm, victims, kill_every_s, deadline, stats)
        await trio.sleep(warmup_s)
        rss_warm = {d.name: _rss_mb(d) for d in long_lived}
    elapsed = trio.current_time() - started
    rss_end = {d.name: _rss_mb(d) for d in long_lived}
    growth = {name: (rss_end[name] - rss_warm[name]) / rss_warm[name] for name in rss_end}
    p50, p95 = _percentile(stats.gaps, 0.5), _percentile(stats.gaps, 0.95)
    return {
        "duration_s": round(elapsed, 1),
        "clients": clients,
        "kill_every_s": kill_every_s,
        "kills": sum(not kill.startswith("none") for kill in stats.kills),
        "killed": stats.kills,
        "completed": stats.completed,
        "failed": stats.failed,
        "mismatched": stats.mismatched,
        "tokens": stats.tokens,
        "new_tokens": new_tokens,
        "token_latency_p50_s": p50,
        "token_latency_p95_s": p95,
        "token_latency_max_s": max(stats.gaps, default=None),
        "ttft_p50_s": _percentile(stats.first_token, 0.5),
        "warmup_s": warmup_s,
        "rss_start_mb": {k: round(v, 1) for k, v in rss_start.items()},
        "rss_warm_mb": {k: round(v, 1) for k, v in rss_warm.items()},
        "rss_end_mb": {k: round(v, 1) for k, v in rss_end.items()},
        "rss_growth_by_daemon": {k: round(v, 4) for k, v in growth.items()},
        "rss_growth": round(max(growth.values()), 4),
        "errors": stats.errors[:10],
    }


def run_soak_bench(
    *,
    duration_s: float = 300.0,
    clients: int = 4,
    kill_every_s: float = 30.0,
    new_tokens: int = 24,
    warmup_s: float | None = None,
    spans: tuple[str, ...] = ("0:15", "15:30"),
) -> dict[str, Any]:
    """Run the soak for `duration_s` (plus the in-flight generations' end) and report."""
    if duration_s <= 0 or clients < 1 or kill_every_s <= 0:
        raise ValueError("duration, clients and kill interval must be positive")
    warmup = min(60.0, duration_s / 5) if warmup_s is None else warmup_s
    if not 0 <= warmup < duration_s:
        raise ValueError(f"the warm-up ({warmup} s) must be shorter than the run ({duration_s} s)")
    swarm = LocalSwarm(refresh_period=2.0, torch_threads=1)
    started = time.perf_counter()
    try:
        # The first daemon is everyone's initial peer; the others start side by side.
        first = swarm.start("s0", spans[0])
        with ThreadPoolExecutor(max_workers=2 * len(spans)) as pool:
            others = [pool.submit(swarm.start, f"s{i}", span) for i, span in enumerate(spans)][1:]
            fast = ("--throughput", VICTIM_THROUGHPUT)
            victim_starts = [
                pool.submit(swarm.start, f"v{i}", span, *fast) for i, span in enumerate(spans)
            ]
            client_start = pool.submit(swarm.start, "client", "none")
            long_lived = [first, *(future.result() for future in others)]
            victims = [
                (future.result(), span) for future, span in zip(victim_starts, spans, strict=True)
            ]
            client = client_start.result()
        setup_s = time.perf_counter() - started
        report = trio.run(
            lambda: _soak(
                swarm,
                client,
                [client, *long_lived],
                victims,
                duration_s=duration_s,
                clients=clients,
                kill_every_s=kill_every_s,
                new_tokens=new_tokens,
                warmup_s=warmup,
            )
        )
        report["spans"] = list(spans)
        report["setup_s"] = round(setup_s, 1)
        return report
    finally:
        swarm.stop()
