"""`peerd bench fairness`: does a loaded swarm serve first the peers that serve it?

Three local daemons (blocks 0:10, 10:20, 20:30 of the default model) are saturated by pure
clients (in-process leeches, each its own peer id: `takers` peers x `sessions_per_taker` sessions,
8 in all by default, each generating from a long prompt again and again, so the servers' turns
are full of prefill chunks), while a fourth daemon that serves blocks too (29:30: its own routes
use it, nobody else's need it) generates in 2 sessions of its own through its local API. The
servers learn its standing from their swarm views (it must serve for peerd.server.standing's
QUALIFY_S first: the bench waits until each of the three counts one contributor).

Reported per class: the median time between two generated tokens (after the first), the
contributor's also unloaded (alone on the same swarm, just before), and the share of the three
servers' work (tokens run through their blocks, from their metrics) each class got under load.
The whole thing runs once with `--priority standing` and once with `--priority fifo` on fresh
swarms, same run. The clients' own work (embedding, LM head, sampling of 10 sessions) runs on the
same cores as the daemons: the latencies are of one loaded machine, compare them side by side.
Hop by hop, from the servers' step-time metrics: how long a step of each class waited on each
server and ran in its forwards, unloaded and loaded (where a token's time goes).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

import blocks
import wire
from peerd.devtools.localswarm import DaemonProcess, LocalSwarm, scrape_metrics
from peerd.node import compute_thread
from peerd.node.p2p import open_node, parse_peer_maddr
from peerd.sdk.async_client import AsyncClient
from peerd.session.generation import Generator
from peerd.session.inference import InferenceSession
from peerd.session.leech import covered
from peerd.session.swarm import SwarmView

SPANS = ("0:10", "10:20", "20:30")
CONTRIBUTOR_SPAN = "29:30"
# Pure clients' prompts: long enough that each is several prefill chunks on every server.
TAKER_PROMPT = " ".join(["The history of the printing press begins in the fifteenth century."] * 12)
TAKER_NEW_TOKENS = 16
# The measuring window lasts until the takers too have generated this many tokens after their
# first (a loaded swarm may serve the contributor before any taker gets past its prefill).
MIN_TAKER_TOKENS = 16
TAKER_WAIT_S = 300.0
CONTRIBUTOR_PROMPT = "Once upon a time, there was a little"
# How long the servers' views may take to grant the contributor standing (qualify + looks).
STANDING_WAIT_S = 240.0
# The daemons' and the pure clients' refresh period: production's default (peerd start
# --refresh-period). At the 2 s of test swarms each daemon's upkeep (look-ups, record puts, info
# calls) took ~22% of a core, 0.9 of this machine's 2 cores for the four daemons, and the pure
# clients' views refreshing every 5 s another 0.36 core of the bench process: load at normal
# priority that no real server sees, which slowed the contributor's forwards both unloaded and
# loaded.
REFRESH_PERIOD_S = 60.0


async def _scrape(ports: list[int]) -> list[dict[str, float]]:
    """One scrape of each server's metrics, in the order of `ports`."""
    return [await trio.to_thread.run_sync(scrape_metrics, port) for port in ports]


def _work(scrapes: list[dict[str, float]]) -> dict[str, float]:
    """Tokens the servers ran, by class, summed over the servers."""
    out = {"contributor": 0.0, "taker": 0.0}
    for values in scrapes:
        for kind in out:
            out[kind] += values.get(f'peerd_priority_work_total{{class="{kind}",queue="turns"}}', 0)
    return out


def _hops(before: list[dict[str, float]], after: list[dict[str, float]], kind: str) -> list:
    """Per server (hop), the mean wait and forward of `kind`'s steps between two scrapes, in ms."""
    label = f'class="{kind}"'
    keys = {
        "steps": f"peerd_timed_steps_total{{{label}}}",
        "wait_ms": f'peerd_step_seconds_total{{{label},part="wait"}}',
        "forward_ms": f'peerd_step_seconds_total{{{label},part="forward"}}',
    }
    hops = []
    for b, a in zip(before, after, strict=True):
        got = {name: a.get(key, 0.0) - b.get(key, 0.0) for name, key in keys.items()}
        per = 1000 / got["steps"] if got["steps"] else math.nan
        hops.append(
            {
                "steps": int(got["steps"]),
                "wait_ms": round(got["wait_ms"] * per, 1),
                "forward_ms": round(got["forward_ms"] * per, 1),
            }
        )
    return hops


async def _wait_for_standing(ports: list[int]) -> float:
    """Seconds until every server counts the contributor: each counts the other servers too
    (they serve blocks of the model), so len(ports) contributors in all."""
    began = time.monotonic()
    with trio.fail_after(STANDING_WAIT_S):
        while True:
            scrapes = await _scrape(ports)
            if all(s.get("peerd_contributors", 0) >= len(ports) for s in scrapes):
                return time.monotonic() - began
            await trio.sleep(2)


async def _contributor_session(daemon: DaemonProcess, new_tokens: int) -> list[float]:
    """Gaps between tokens of one generation through the contributor daemon's local API."""
    times: list[float] = []
    async with AsyncClient(daemon.socket, timeout=120) as client:
        async for message in client.stream_tokens(CONTRIBUTOR_PROMPT, max_new_tokens=new_tokens):
            if isinstance(message, wire.GeneratedToken):
                times.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(times)]


async def _contributor(daemon: DaemonProcess, sessions: int, new_tokens: int, reps: int) -> list:
    gaps: list[float] = []

    async def one() -> None:
        gaps.extend(await _contributor_session(daemon, new_tokens))

    for _ in range(reps):
        async with trio.open_nursery() as nursery:
            for _ in range(sessions):
                nursery.start_soon(one)
    return gaps


async def _taker(
    generator: Generator,
    swarm: SwarmView,
    ids: Any,
    gaps: list[tuple[float, float]],
    errors: list[str],
) -> None:
    """Generate TAKER_NEW_TOKENS from a long prompt, again and again: (when, gap) of each token
    after the first into `gaps`."""
    while True:
        last = None
        try:
            async with InferenceSession(
                swarm, max_length=ids.shape[1] + TAKER_NEW_TOKENS
            ) as session:
                async for _ in generator.generate(ids, TAKER_NEW_TOKENS, session=session):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now, now - last))
                    last = now
        except Exception as e:  # a pure client that fails starts over, as a user would
            errors.append(f"{type(e).__name__}: {e}")
            await trio.sleep(1)


@asynccontextmanager
async def _taker_views(
    swarm: LocalSwarm, client: blocks.ClientSide, count: int
) -> AsyncIterator[list[SwarmView]]:
    """`count` pure clients, each its own libp2p host (peer id) and swarm view."""
    async with AsyncExitStack() as stack:
        views = []
        for _ in range(count):
            node = await stack.enter_async_context(
                open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
            )
            await node.connect(parse_peer_maddr(swarm.initial_peers[0]))
            num_blocks = int(client.config.num_hidden_layers)
            view = SwarmView(node, client.model, num_blocks, refresh_period=REFRESH_PERIOD_S)
            await view.wait_for(covered, 60)
            views.append(view)
        yield views


async def _loaded(
    swarm: LocalSwarm, contributor: DaemonProcess, ports: list[int], args: dict
) -> tuple[list[float], list[float], dict[str, float]]:
    """(contributor's gaps, takers' gaps, work by class) while the takers saturate the swarm."""
    # On the compute thread, as open_leech: one OpenMP team in the process (compute_thread).
    client = await compute_thread.run(blocks.load_client_side, blocks.resolve_checkpoint("default"))
    ids = client.tokenizer(TAKER_PROMPT, return_tensors="pt")["input_ids"]
    taker_gaps: list[tuple[float, float]] = []
    async with _taker_views(swarm, client, args["takers"]) as views, trio.open_nursery() as nursery:
        for view in views:
            nursery.start_soon(view.run)
            for _ in range(args["sessions_per_taker"]):
                nursery.start_soon(
                    _taker, Generator(client, view), view, ids, taker_gaps, args["errors"]
                )
        await trio.sleep(args["ramp_s"])  # every taker session busy
        before, began = await _scrape(ports), time.perf_counter()
        loaded = await _contributor(
            contributor, args["contributor_sessions"], args["new_tokens"], args["reps"]
        )
        with trio.move_on_after(TAKER_WAIT_S):
            while sum(at >= began for at, _ in taker_gaps) < MIN_TAKER_TOKENS:
                await trio.sleep(0.5)
        after, ended = await _scrape(ports), time.perf_counter()
        args["hops_loaded"] = {
            kind: _hops(before, after, kind) for kind in ("contributor", "taker")
        }
        nursery.cancel_scope.cancel()
    theirs = [gap for at, gap in taker_gaps if began <= at <= ended]
    work_before, work_after = _work(before), _work(after)
    return loaded, theirs, {kind: work_after[kind] - work_before[kind] for kind in work_after}


async def _measure(swarm: LocalSwarm, contributor: DaemonProcess, args: dict) -> dict[str, Any]:
    ports = [d.metrics_port() for d in swarm.daemons[: len(SPANS)]]
    waited = await _wait_for_standing(ports)
    sessions = args["contributor_sessions"]
    await _contributor(contributor, sessions, 4, 1)  # warm-up
    before = await _scrape(ports)
    unloaded = await _contributor(contributor, sessions, args["new_tokens"], args["reps"])
    hops_unloaded = _hops(before, await _scrape(ports), "contributor")
    loaded, taker_gaps, work = await _loaded(swarm, contributor, ports, args)
    # Unloaded again after the load: the machine's other work drifts; count both.
    unloaded += await _contributor(contributor, sessions, args["new_tokens"], args["reps"])
    total = sum(work.values()) or 1.0
    alone = statistics.median(unloaded)
    mine = statistics.median(loaded)
    # nan: no taker got a token past its first within TAKER_WAIT_S (they wait for their prefills)
    theirs = statistics.median(taker_gaps) if taker_gaps else math.nan
    return {
        "contributor_unloaded_token_s": round(alone, 4),
        "contributor_loaded_token_s": round(mine, 4),
        "taker_loaded_token_s": round(theirs, 4),
        "contributor_vs_unloaded": round(mine / alone, 3),
        "contributor_vs_takers": round(mine / theirs, 3),
        "contributor_work_share": round(work["contributor"] / total, 3),
        "taker_work_share": round(work["taker"] / total, 3),
        "standing_after_s": round(waited, 1),
        # Hop by hop (servers 0:10, 10:20, 20:30), the mean time a step spent waiting on the
        # server's batcher and in its forwards: what of a token's gap the servers account for.
        "contributor_hops_unloaded": hops_unloaded,
        "contributor_hops_loaded": args["hops_loaded"]["contributor"],
        "taker_hops_loaded": args["hops_loaded"]["taker"],
        "tokens": {"contributor": len(loaded), "taker": len(taker_gaps)},
        "taker_errors": len(args["errors"]),
        "first_taker_errors": sorted(set(args["errors"]))[:3],
    }


def _start(priority: str) -> tuple[LocalSwarm, DaemonProcess]:
    swarm = LocalSwarm(refresh_period=REFRESH_PERIOD_S, torch_threads=1)
    extra = ("--priority", priority, "--metrics-port", "0")
    for name, span in zip("abc", SPANS, strict=True):
        swarm.start(name, span, *extra)
    return swarm, swarm.start("contributor", CONTRIBUTOR_SPAN, *extra)


def run_fairness_bench(
    *,
    takers: int = 4,
    sessions_per_taker: int = 2,
    contributor_sessions: int = 2,
    new_tokens: int = 24,
    reps: int = 2,
    ramp_s: float = 10.0,
    modes: tuple[str, ...] = ("standing", "fifo"),
) -> dict[str, Any]:
    """Per priority mode, the contributor's and the takers' token latency and work share."""
    args = {
        "takers": takers,
        "sessions_per_taker": sessions_per_taker,
        "contributor_sessions": contributor_sessions,
        "new_tokens": new_tokens,
        "reps": reps,
        "ramp_s": ramp_s,
    }
    report: dict[str, Any] = {**args, "taker_sessions": takers * sessions_per_taker}
    for mode in modes:
        swarm, contributor = _start(mode)
        try:
            report[mode] = trio.run(_measure, swarm, contributor, {**args, "errors": []})
        finally:
            swarm.stop()
    if "standing" in report:
        s = report["standing"]
        report["standing_meets_acceptance"] = (
            s["contributor_vs_unloaded"] <= 1.5
            and s["contributor_vs_takers"] <= 0.6
            and s["taker_work_share"] >= 0.2
        )
    return report
