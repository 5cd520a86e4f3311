"""`peerd bench wan`: generation over an emulated wide-area network (peerd.devtools.netns): three
servers
(blocks 0:10, 10:20, 20:30) and a client, each on its own host whose link adds 25 ms one way
and carries at most 100 Mbit/s. The per-token latency is compared with its floor, measured in
the same run: the network delay along the route plus the compute of every span and of the
client's own part (embeddings, LM head).

With server-to-server push a token travels client -> s1 -> s2 -> s3 -> client: 4 one-way
delays. Without push every hop is a round trip from the client: 2 per span, 6 in all. The
client runs in its own namespace (a child process, `--inner`), as a volunteer's daemon would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

SPANS = ((0, 10), (10, 20), (20, 30))
DELAY_MS = 25.0
RATE_MBIT = 100.0
# Announcement and swarm-view refresh of every daemon here (the default is 60 s): often enough
# to find each other at once, rarely enough that four daemons' DHT work on two cores does not
# land in the middle of the tokens being timed (as `peerd bench batch`).
REFRESH_S = 30.0
# The floor's span compute: the median of FLOOR_STEPS decode steps after a prompt of FLOOR_PAST
# tokens (about the bench prompt's length) and FLOOR_WARM_UP steps not timed.
FLOOR_STEPS = 40
FLOOR_PAST = 64
FLOOR_WARM_UP = 4


def one_way_delays(push: bool, hops: int) -> int:
    """Link traversals per token: push goes round the ring once, else each hop is a round trip
    from the client."""
    return hops + 1 if push else 2 * hops


def run_wan_bench(new_tokens: int = 16, runs: int = 2) -> dict[str, Any]:
    """Build the topology, start the servers, run the measurement in the client's namespace."""
    report, via = run_on_emulated_wan("peerd.bench.wan", new_tokens, runs, timeout_s=900)
    report["link"] = {"one_way_delay_ms": DELAY_MS, "rate_mbit": RATE_MBIT, "via": via}
    return report


def run_on_emulated_wan(
    module: str, new_tokens: int, runs: int, *, timeout_s: float
) -> tuple[dict[str, Any], list[str]]:
    """Start the servers of SPANS on hosts of an emulated WAN and run `python -m module --inner`
    as the client in its own namespace; return the JSON object it printed last and the shaping
    that was applied (what netem/tbf limited, per host)."""
    from peerd.devtools import netns
    from peerd.devtools.localswarm import LocalSwarm

    with netns.topology() as topo:
        hosts = [topo.add_public(f"s{i + 1}") for i in range(len(SPANS))]
        client = topo.add_public("client")
        shaping = {topo.shape(h, DELAY_MS, RATE_MBIT) for h in [*hosts, client]}
        swarm = LocalSwarm(refresh_period=REFRESH_S, torch_threads=1)
        try:
            # One after another, as the servers of a real swarm start on their own machines
            # (LocalSwarm.start's `online`).
            for host, (start, end) in zip(hosts, SPANS, strict=True):
                swarm.start(host.name, f"{start}:{end}", host=host, online=True)
            inner = subprocess.run(
                [*client.exec_args(), sys.executable, "-m", module, "--inner",
                 "--initial-peer", swarm.initial_peers[0], "--listen", client.ip,
                 "--new-tokens", str(new_tokens), "--runs", str(runs)],
                capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
        finally:
            swarm.stop()
    if inner.returncode != 0:
        raise RuntimeError(f"the client ({module}) failed:\n{inner.stderr[-3000:]}")
    return json.loads(inner.stdout.strip().splitlines()[-1]), sorted(shaping)


def _compute_per_token(client_side: Any) -> tuple[list[float], float]:
    """Seconds one decode token spends in each span (median_step_seconds, as the servers run it:
    one torch thread, the passes compiled where theirs are) and in the client's own part
    (embedding, final norm, LM head and the greedy pick, as the bench's generations decode)."""
    import torch

    import blocks

    torch.set_num_threads(1)
    checkpoint = blocks.resolve_checkpoint("default")
    spans = []
    for start, end in SPANS:
        span = blocks.load_span(checkpoint, start, end, torch.float32, "cpu")
        if servers_compile():
            span.compile_passes()
        spans.append(median_step_seconds(span))
        del span
    ids = torch.tensor([[42]])
    times = []
    with torch.inference_mode():
        for _ in range(20):
            started = time.perf_counter()
            client_side.greedy(client_side.embed(ids)[:, -1])
            times.append(time.perf_counter() - started)
    return spans, statistics.median(times)


def median_step_seconds(span: Any, steps: int = FLOOR_STEPS, past: int = FLOOR_PAST) -> float:
    """The median of `steps` one-token decode steps of `span` (a blocks.Span), back to back in one
    session after a prompt of `past` tokens and a few steps of warm-up. A median, not the mean of
    blocks.measure_throughput's 16 steps: one slow stretch of the machine while the floor was
    measured (a span timed at 29.9 ms, 14-17 ms in the run before) took a run's `ratio` to 0.999
    where its token latency over the usual floor gave ~1.13."""
    import torch

    from blocks.cache import MemoryCache

    hidden = span.config.hidden_size
    length = past + FLOOR_WARM_UP + steps  # the session's tokens: the prompt and every step
    cache = MemoryCache(budget_tokens=length + 8)
    times = []
    with torch.inference_mode(), cache.open_session(1, length) as session:
        span(torch.randn(1, past, hidden), session)
        for i in range(FLOOR_WARM_UP + steps):
            step = torch.randn(1, 1, hidden)
            started = time.perf_counter()
            span(step, session)
            if i >= FLOOR_WARM_UP:
                times.append(time.perf_counter() - started)
    return statistics.median(times)


def servers_compile() -> bool:
    """Whether the servers started here compile their passes: `peerd start --compile`, the
    default, unless PEERD_COMPILE turns it off (read by click's own bool type, as the flag's is;
    unset or empty: the default)."""
    import click

    return bool(click.BOOL.convert(os.environ.get("PEERD_COMPILE") or "1", None, None))


def _tcp_rtt(addrs: list[Any], tries: int = 7) -> float:
    """The median TCP connect time (peerd.devtools.netns.connect_seconds) to `addrs`
    (/ip4/.../tcp/... multiaddrs), over every try."""
    from peerd.devtools.netns import connect_seconds

    pairs = [(a.value_for_protocol("ip4"), int(a.value_for_protocol("tcp"))) for a in addrs]
    return statistics.median(connect_seconds(pairs, tries))


def _inner(initial_peer: str, listen: str, new_tokens: int, runs: int) -> dict[str, Any]:
    import torch
    import trio
    from libp2p.peer.id import ID

    from peerd.bench.swarm import PROMPT, _swarm_run
    from peerd.session.leech import open_leech

    torch.set_num_threads(1)  # the client's part, timed for the floor with one thread too

    async def measure() -> dict[str, Any]:
        async with open_leech(
            "default", [initial_peer], refresh_period=REFRESH_S, listen=f"/ip4/{listen}/tcp/0"
        ) as leech:
            ids = leech.client.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
            await _swarm_run(leech, ids, 4)  # warm-up: connections, first allocations
            latency: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(runs):
                for push in (True, False):
                    _, tps, _ = await _swarm_run(leech, ids, new_tokens, push)
                    latency[push].append(1.0 / tps)
            route = leech.swarm.plan()
            spans_s, client_s = await trio.to_thread.run_sync(_compute_per_token, leech.client)
            store = leech.node.host.get_peerstore()
            addrs = [a for hop in route for a in store.addrs(ID.from_base58(hop.peer_id))[:1]]
            link_rtt_s = await trio.to_thread.run_sync(_tcp_rtt, addrs)
        compute_s = sum(spans_s) + client_s
        rows: list[dict[str, Any]] = []
        for push in (True, False):
            network_s = one_way_delays(push, len(route)) * DELAY_MS / 1000
            token_s = statistics.median(latency[push])
            floor_s = network_s + compute_s
            # The same floor with each leg's delay as the links realise it (half a TCP connect's
            # round trip from the client to the route's servers): what the emulator adds.
            measured_s = one_way_delays(push, len(route)) * link_rtt_s / 2 + compute_s
            rows.append(
                {
                    "push": push,
                    "token_latency_s": token_s,
                    "floor_s": floor_s,
                    "ratio": token_s / floor_s,
                    "network_s": network_s,
                    "floor_on_measured_links_s": measured_s,
                    "ratio_on_measured_links": token_s / measured_s,
                    "all_token_latencies_s": latency[push],
                }
            )
        return {
            "results": rows,
            "push_saves_s": rows[1]["token_latency_s"] - rows[0]["token_latency_s"],
            "compute_per_span_s": spans_s,
            "client_compute_s": client_s,
            "link_rtt_s": link_rtt_s,
            "route": [f"{hop.start}:{hop.end}@{hop.peer_id[-8:]}" for hop in route],
            "new_tokens": new_tokens,
            "runs": runs,
        }

    return trio.run(measure)


def inner_main(
    bench: str, inner: Callable[[str, str, int, int], dict[str, Any]], new_tokens: int
) -> None:
    """The client half that run_on_emulated_wan starts in its namespace: parse the arguments it
    passes, run `inner(initial_peer, listen, new_tokens, runs)`, print its report as JSON."""
    parser = argparse.ArgumentParser(description=f"the client half of `peerd bench {bench}`")
    parser.add_argument("--inner", action="store_true", required=True)
    parser.add_argument("--initial-peer", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    report = inner(args.initial_peer, args.listen, args.new_tokens, args.runs)
    print(json.dumps(report), flush=True)


def main() -> None:
    inner_main("wan", _inner, 16)


if __name__ == "__main__":
    main()
