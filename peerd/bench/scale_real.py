"""`peerd bench scale --real N`: the simulator of `peerd bench scale` checked against a real swarm
(issue 23). N server daemons and a few client daemons of a tiny random model, each in a network
namespace of its own (peerd.devtools.netns) whose link delays the packets it receives, and the
simulator (routing.simulate_run.run_given) run over the same swarm: the same identities, spans,
throughputs and delays, the same clients one after another. Both report the median first-route
time, the messages per Kademlia look-up and the median route cost against the offline optimum;
the report gives each side by side, sim/real, and whether they agree within 25%.

The network: every peer's access delay is drawn by routing.netsim's latency model (a fixed seed),
scaled so that the median round trip between two servers is `median_rtt_s`. A host's link can
only be shaped as a whole, so all peers sit at one point of netsim's plane (a star): the round
trip between two peers is the sum of their hosts' delays, what the namespaces realise and what
the simulator is given (routing.netsim's `place`). The servers' spans are those the simulated
servers chose with `choose_blocks`, joining in the same order; the real ones are started on them.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routing.chains import Route, RouteHop
from routing.netsim import Network
from routing.records import SwarmSnapshot
from routing.simulate import ServerSpec
from routing.simulate_run import quantiles, run_given

SERVERS = 24
CLIENTS = 5
NUM_BLOCKS = 24
# Blocks a server holds, drawn uniformly: a few of the model's 24, so that 24 servers hold every
# block several times over and a route has alternatives at every boundary.
SPAN_BLOCKS = (3, 8)
# Issue 23: the two agree when sim/real is within 25% of 1 for each figure.
AGREEMENT = 0.25
# Each host's link rate: far above what discovery sends, so only the delays count (netsim's
# median 20 Mbit/s moves a 300-byte reply in 0.1 ms).
RATE_MBIT = 100.0
# The servers' refresh period (how often each publishes its record and refreshes its view):
# production's. Every refresh asks each server the view knows for its live record, so 24
# servers at 10 s kept both cores busy (load average 26) and a client found no route in 90 s.
# The clients refresh sooner: a first refresh that leaves a block unserved is retried in
# CLIENT_REFRESH_S. The swarm settles one server period after the last start, so that every
# record is stored again at the holders closest to its key once the DHT holds every server.
REFRESH_PERIOD_S = 60.0
CLIENT_REFRESH_S = 10.0
SETTLE_S = 70.0
FIRST_ROUTE_TIMEOUT_S = 90.0
# A Kademlia query and its reply: routing.netsim counts both; the daemon counts queries sent.
MESSAGES_PER_QUERY = 2

# The client daemon's discovery metrics (peerd/session/directory.py): the first route and what
# the refreshes up to it cost.
FIRST_ROUTE_METRIC = "peerd_discovery_first_route_seconds"
FIRST_ROUTE_FIGURES = {
    "lookups": "peerd_discovery_first_route_lookups",
    "lookup_queries": "peerd_discovery_first_route_lookup_messages",
    "bytes": "peerd_discovery_first_route_record_bytes",
    "contacts": "peerd_discovery_first_route_contacts",
}
COMPARED = ("first_route_s", "messages_per_lookup", "cost_vs_optimum")


@dataclass(frozen=True)
class Plan:
    """The swarm both sides run: servers (identity seed, access delay, span length, throughput)
    and, per host, the delay its link adds to every packet it receives."""

    num_blocks: int
    servers: tuple[ServerSpec, ...]
    server_delays_s: tuple[float, ...]
    client_delays_s: tuple[float, ...]

    @staticmethod
    def rtt(delay_a: float, delay_b: float) -> float:
        """Round trip between two hosts: each way waits the receiving host's delay."""
        return delay_a + delay_b


def draw_plan(
    servers: int = SERVERS,
    clients: int = CLIENTS,
    *,
    num_blocks: int = NUM_BLOCKS,
    seed: int = 0,
    median_rtt_s: float = 0.05,
) -> Plan:
    """Servers and clients with access delays from routing.netsim's model, scaled so that the
    median round trip over pairs of servers is `median_rtt_s`; span lengths in SPAN_BLOCKS and
    device speeds as routing.simulate draws them."""
    if servers < 2 or clients < 1 or num_blocks < SPAN_BLOCKS[1]:
        raise ValueError(
            f"need at least 2 servers, 1 client and {SPAN_BLOCKS[1]} blocks, got {servers}, "
            f"{clients} and {num_blocks}"
        )
    net = Network(random.Random(seed))
    access = [net.add(f"peer-{i}").access_s for i in range(servers + clients)]
    # netsim's round trip between two peers at one point: twice the sum of their access delays.
    pairs = sorted(2 * (a + b) for a, b in itertools.combinations(access[:servers], 2))
    scale = median_rtt_s / pairs[len(pairs) // 2]
    delays = [scale * 2 * a for a in access]
    rng = random.Random(seed + 1)
    specs = []
    for delay in delays[:servers]:
        span_len = rng.randint(*SPAN_BLOCKS)
        speed = rng.lognormvariate(7.0, 0.6)  # block steps/s of the device, as routing.simulate
        # netsim's place(access_s) gives round trips of 2 * (access + access): half the delay.
        specs.append(ServerSpec(rng.randbytes(32), delay / 2, span_len, speed / span_len))
    return Plan(num_blocks, tuple(specs), tuple(delays[:servers]), tuple(delays[servers:]))


def run_simulated(plan: Plan, *, seed: int = 0) -> dict[str, Any]:
    """The simulator over the plan's swarm and clients (routing.simulate_run.run_given)."""
    clients = [delay / 2 for delay in plan.client_delays_s]  # netsim's access: half the delay
    return run_given(plan.servers, clients, num_blocks=plan.num_blocks, seed=seed)


def parse_route(hops: Sequence[str], truth: SwarmSnapshot) -> Route:
    """A route as the local API lists it ('peer[start:end)' per hop), over `truth`'s records."""
    route = []
    for hop in hops:
        peer_id, _, span = hop.partition("[")
        start, _, end = span.rstrip(")").partition(":")
        if peer_id not in truth.by_peer or not start.isdigit() or not end.isdigit():
            raise ValueError(f"route hop {hop!r} is not 'peer[start:end)' of a known server")
        route.append(RouteHop(peer_id, int(start), int(end), truth.by_peer[peer_id]))
    return tuple(route)


def summarize_real(clients: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The real clients' figures as the simulator reports them: medians of first-route time and
    route cost, messages per look-up over all look-ups (MESSAGES_PER_QUERY per query sent)."""
    timed = [c for c in clients if c.get("first_route_s")]
    lookups = sum(c.get("lookups") or 0 for c in timed)
    queries = sum(c.get("lookup_queries") or 0 for c in timed)
    costs = [c["cost_ratio"] for c in clients if c.get("cost_ratio") is not None]
    failed = sum(1 for c in clients if c.get("failed"))
    return {
        "routed": len(clients) - failed,
        "failed": failed,
        "first_route_s": quantiles([c["first_route_s"] for c in timed]),
        "messages_per_lookup": round(MESSAGES_PER_QUERY * queries / lookups, 2)
        if lookups
        else None,
        "lookups": quantiles([float(c.get("lookups") or 0) for c in timed]),
        "contacts": quantiles([float(c.get("contacts") or 0) for c in timed]),
        "bytes_per_plan": quantiles([float(c.get("bytes") or 0) for c in timed]),
        "cost_vs_optimum": quantiles(costs),
    }


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Each figure both report, sim/real, and whether it is within AGREEMENT of 1."""

    def figure(report: dict[str, Any], name: str) -> float | None:
        value = report.get(name)
        return value.get("median") if isinstance(value, dict) else value

    figures = {}
    for name in COMPARED:
        real_value, sim_value = figure(real, name), figure(sim, name)
        ratio = round(sim_value / real_value, 3) if real_value and sim_value is not None else None
        figures[name] = {
            "real": real_value,
            "sim": sim_value,
            "sim_over_real": ratio,
            "agree": ratio is not None and abs(ratio - 1) <= AGREEMENT,
        }
    return {"figures": figures, "agree": all(f["agree"] for f in figures.values())}


def build_tiny_model(directory: Path, num_blocks: int, *, chat_template: bool = True) -> Path:
    """A tiny random llama of `num_blocks` blocks with the default model's tokenizer (so the
    daemons load it as any checkpoint), saved to `directory`; `chat_template` False: the
    tokenizer's chat template removed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    import blocks

    tokenizer = AutoTokenizer.from_pretrained(blocks.resolve_checkpoint("default"))
    if not chat_template:
        tokenizer.chat_template = None
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def metric(values: dict[str, float], name: str) -> float | None:
    """A metric's value from a scrape, labelled or not (the first series); None if absent."""
    for key, value in values.items():
        if key == name or key.startswith(name + "{"):
            return value
    return None


def python_in(netns: str, code: str, *args: str, timeout: float = 60.0) -> str:
    """Run `python -c code args` inside network namespace `netns`; its standard output."""
    done = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"a probe in {netns} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def scrape_in(netns: str, port: int, timeout: float = 30.0) -> dict[str, float]:
    """One scrape of a daemon's /metrics inside network namespace `netns` (where its 127.0.0.1
    is): `name{labels}` -> value, as peerd.devtools.localswarm.scrape_metrics gives it."""
    fetch = (
        "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], "
        "timeout=float(sys.argv[2])).read().decode())"
    )
    url = f"http://127.0.0.1:{port}/metrics"
    from peerd.devtools.localswarm import parse_metrics

    return parse_metrics(python_in(netns, fetch, url, str(timeout), timeout=timeout + 10))


def tcp_rtts(netns: str, addresses: Sequence[tuple[str, int]]) -> list[float]:
    """From inside `netns`, the seconds a TCP connect to each address takes
    (peerd.devtools.netns.connect_seconds)."""
    probe = (
        "import sys\n"
        "from peerd.devtools.netns import connect_seconds\n"
        "pairs = [(a.rsplit(':', 1)[0], int(a.rsplit(':', 1)[1])) for a in sys.argv[1:]]\n"
        "print(*connect_seconds(pairs), sep='\\n')"
    )
    out = python_in(netns, probe, *(f"{ip}:{port}" for ip, port in addresses))
    return [float(line) for line in out.split()]


def format_report(report: dict[str, Any]) -> str:
    """One line per compared figure, then the verdict."""
    lines = [
        f"{report['servers']} server daemons, {report['clients']} clients, "
        f"{report['blocks']} blocks, median RTT {report['median_rtt_s'] * 1000:g} ms "
        f"(wall {report['wall_s']} s)"
    ]
    for name, f in report["comparison"]["figures"].items():
        verdict = "agree" if f["agree"] else "DIFFER"
        lines.append(
            f"  {name}: real {f['real']}, sim {f['sim']}, sim/real {f['sim_over_real']} ({verdict})"
        )
    lines.extend(f"  note: {note}" for note in report.get("notes", ()))
    agree = report["comparison"]["agree"]
    lines.append(f"within {AGREEMENT:.0%} on every figure: {'yes' if agree else 'NO'}")
    return "\n".join(lines)


def run_scale_real_bench(
    servers: int = SERVERS,
    clients: int = CLIENTS,
    *,
    num_blocks: int = NUM_BLOCKS,
    seed: int = 0,
    median_rtt_s: float = 0.05,
    settle_s: float = SETTLE_S,
    progress: bool = True,
) -> dict[str, Any]:
    """Draw the plan, simulate it, run it as real daemons, compare (the module's docstring)."""
    import tempfile

    from peerd.bench.scale_real_swarm import run_real

    def say(line: str) -> None:
        if progress:
            print(f"[{line}]", file=sys.stderr, flush=True)

    started = time.perf_counter()
    plan = draw_plan(servers, clients, num_blocks=num_blocks, seed=seed, median_rtt_s=median_rtt_s)
    sim = run_simulated(plan, seed=seed)
    say(f"simulated: first route {sim['first_route_s']}, cost {sim['cost_vs_optimum']}")
    with tempfile.TemporaryDirectory(prefix="peerd-bench-scale-real-") as workdir:
        real_clients, notes = run_real(plan, sim["spans"], Path(workdir), say, settle_s)
    real = summarize_real(real_clients)
    return {
        "servers": servers,
        "clients": clients,
        "blocks": num_blocks,
        "median_rtt_s": median_rtt_s,
        "seed": seed,
        "server_delays_ms": [round(d * 1000, 2) for d in plan.server_delays_s],
        "client_delays_ms": [round(d * 1000, 2) for d in plan.client_delays_s],
        "spans": sim["spans"],
        "real": real | {"clients": real_clients},
        "sim": sim,
        "comparison": compare(real, sim),
        "notes": notes,
        "wall_s": round(time.perf_counter() - started, 1),
    }
