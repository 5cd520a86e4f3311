"""`peerd bench attack`: every attack of the security review (../shared/reviews/security.md) run in
turn against a live swarm while an honest client keeps generating; does the swarm hold?

The swarm: three daemons of the default model on 127.0.0.1, s0 (blocks 0:10), s1 (10:20) and
s2 (20:30); the honest client generates through s2's local API without pause, greedy, and every
text must equal the one it got before any attack. The attackers are real libp2p nodes of their
own (several peer ids, since peer ids cost nothing) that speak the wire protocol and craft the
hostile messages themselves (peerd.bench.attack_catalogue, .attack_peers).

Per attack the report says:
- `daemon_alive`: every daemon of the swarm still runs (a dead one is restarted before the next
  attack, so each attack is measured on its own);
- `honest_ok`: every honest generation that overlapped the attack, and the first one started
  after it, finished with the right text;
- `honest_slowdown`: median time of those generations over the median before any attack (for
  the attacks whose slowdown is bounded, SLOWDOWN_BOUND_FOR: over the median of generations
  run just before that attack, `baseline_s`);
- `rss_growth_mb`: resident memory of the attacked daemon after the attack (and that first honest
  generation) less before it: memory the attack left behind;
- `loop_stall_ms`: the slowest answer of the attacked daemon's event loop during the attack, as a
  separate probe process measures it (peerd.bench.loop_probe: a status request every 20 ms over
  the local API, which runs on the same trio loop as the peer protocols);
- `detail`: what the attacked daemon answered, and figures of the attack's own (route share...).

`all_held` is true when every attack held by the review's bounds (LIMITS).
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

import blocks
import wire
from peerd.devtools.localswarm import ROOT, DaemonProcess, LocalSwarm
from peerd.node.p2p import Node, open_node, parse_peer_maddr
from peerd.sdk.client import AsyncClient, PeerdError

PROMPT = "The capital of France is"
SPANS = {"s0": "0:10", "s1": "10:20", "s2": "20:30"}
HONEST = "s2"  # the honest client generates through this daemon's local API
# What "held" means (the acceptance bounds).
LIMITS = {"rss_growth_mb": 64.0, "loop_stall_ms": 250.0, "honest_slowdown": 2.0}
SLOWDOWN_BOUND_FOR = ("training_flood",)  # attacks whose honest_slowdown is bounded
PROBE_EVERY = "0.02"  # seconds between two status requests of a probe
# An honest generation taking longer than this failed (a hang).
GENERATION_LIMIT_S = 90.0
# After an attack, how long the first fresh honest generation may take to start and finish.
RECOVERY_LIMIT_S = 120.0
# An attack's own time limit, beyond its flood duration: a hostile peer that hangs is a finding.
ATTACK_LIMIT_S = 120.0


@dataclass
class Generation:
    start: float  # time.monotonic(), comparable with the probes' times
    end: float
    ok: bool
    error: str = ""


class HonestClient:
    """Greedy generations of one prompt through a daemon's socket, back to back, until
    cancelled; each checked against the reference text."""

    def __init__(self, socket: Any, new_tokens: int) -> None:
        self.socket = socket
        self.new_tokens = new_tokens
        self.reference: list[int] | None = None
        self.done: list[Generation] = []

    async def generate(self) -> list[int]:
        ids: list[int] = []
        async with AsyncClient(self.socket) as client:
            async for message in client.stream_tokens(PROMPT, max_new_tokens=self.new_tokens):
                if isinstance(message, wire.GeneratedToken):
                    ids.append(message.token_id)
        return ids

    async def run(self) -> None:
        while True:
            start = time.monotonic()
            try:
                with trio.fail_after(GENERATION_LIMIT_S):
                    ids = await self.generate()
                ok = ids == self.reference
                error = "" if ok else f"wrong text: {ids} instead of {self.reference}"
            except (PeerdError, trio.TooSlowError, OSError) as e:
                ok, error = False, f"{type(e).__name__}: {e}"[:300]
            self.done.append(Generation(start, time.monotonic(), ok, error))
            if not ok:
                await trio.sleep(0.5)  # the daemon may be restarting: do not spin

    async def first_started_after(self, moment: float, limit: float) -> Generation | None:
        """The first generation started after `moment`, once it is done (None: none within
        `limit` seconds)."""
        with trio.move_on_after(limit):
            while True:
                fresh = [g for g in self.done if g.start >= moment]
                if fresh:
                    return fresh[0]
                await trio.sleep(0.05)
        return None


class LoopProbe:
    """peerd.bench.loop_probe against one daemon, its answers collected by a reader thread."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.samples: list[tuple[float, float]] = []  # (sent, latency ms)
        self.gone = ""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "peerd.bench.loop_probe", str(daemon.socket), PROBE_EVERY],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("gone"):
                self.gone = line.strip()
                continue
            sent, latency = line.split()
            self.samples.append((float(sent), float(latency)))

    def worst(self, start: float, end: float) -> float | None:
        """Slowest answer to a request in flight at any time in [start, end], in ms (None: no
        answer at all)."""
        during = [ms for sent, ms in self.samples if start <= sent + ms / 1e3 and sent <= end]
        return max(during) if during else None

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until the probe's first answer (it imports torch first: seconds on a busy machine)."""
        deadline = time.monotonic() + timeout
        while not self.samples:
            if self.gone or time.monotonic() > deadline:
                raise RuntimeError(f"the loop probe never got an answer: {self.gone or 'timeout'}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@dataclass
class Rig:
    """The swarm under attack and what the attacks use."""

    swarm: LocalSwarm
    daemons: dict[str, DaemonProcess]
    model: str
    hidden_size: int
    attack_s: float  # how long a flood lasts
    new_tokens: int  # per honest generation
    num_blocks: int
    attackers: list[Node] = field(default_factory=list)  # distinct peer ids
    victim: Node | None = None  # an honest peer talking the wire itself (push spoofing)
    honest: HonestClient | None = None
    probes: dict[str, LoopProbe] = field(default_factory=dict)

    def revive(self) -> list[str]:
        """Restart every daemon that died (same identity, span and socket); their names."""
        dead = [name for name, d in self.daemons.items() if not d.alive()]
        for name in dead:
            old = self.daemons[name]
            self.probes.pop(name).stop()
            self.swarm.daemons.remove(old)
            with contextlib.suppress(OSError):
                old.socket.unlink()
            fresh = self.swarm.start(name, SPANS[name], identity=old.identity.stem)
            self.daemons[name] = fresh
            self.probes[name] = LoopProbe(fresh)
            self.probes[name].wait_ready()
        return dead


Attack = Callable[[Rig], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class AttackSpec:
    name: str
    target: str  # the daemon whose memory and loop are measured
    run: Attack


def _rss_mb(daemon: DaemonProcess) -> float | None:
    if not daemon.alive():
        return None
    assert daemon.process is not None
    return psutil.Process(daemon.process.pid).memory_info().rss / 2**20


def _median_time(generations: list[Generation]) -> float | None:
    times = [g.end - g.start for g in generations if g.ok]
    return statistics.median(times) if times else None


async def _fresh_baseline(honest: HonestClient, runs: int) -> float | None:
    """The median of the next `runs` honest generations (started from now, none failing): the
    swarm's speed just before an attack whose slowdown is bounded. A shared machine's load
    drifts over a run of every attack; the one before the first attack is a poor reference
    for the eleventh."""
    since = time.monotonic()
    with trio.move_on_after(runs * GENERATION_LIMIT_S):
        while True:
            fresh = [g for g in honest.done if g.start >= since]
            if any(not g.ok for g in fresh):
                return None
            if len(fresh) >= runs:
                return _median_time(fresh)
            await trio.sleep(0.1)
    return None


async def _measure(
    rig: Rig, spec: AttackSpec, baseline_s: float, baseline_runs: int = 3
) -> dict[str, Any]:
    """Run one attack and measure what it did to the swarm."""
    assert rig.honest is not None
    if spec.name in SLOWDOWN_BOUND_FOR:
        baseline_s = await _fresh_baseline(rig.honest, baseline_runs) or baseline_s
    target = rig.daemons[spec.target]
    probe = rig.probes[spec.target]
    rss_before = _rss_mb(target)
    started = time.monotonic()
    try:
        with trio.fail_after(ATTACK_LIMIT_S + rig.attack_s):
            detail = await spec.run(rig)
    except Exception as e:  # the attack could not be made as planned: not held, and why
        detail = {"attack_error": _leaf(e)}
    ended = time.monotonic()
    after = await rig.honest.first_started_after(ended, RECOVERY_LIMIT_S)
    alive = all(d.alive() for d in rig.daemons.values())
    rss_after = _rss_mb(target)
    overlapping = [
        g for g in rig.honest.done if g.end >= started and (after is None or g.start <= after.start)
    ]
    honest_ok = after is not None and all(g.ok for g in overlapping)
    if detail.get("victim_ok") is False:  # an honest peer of the attack's own was hurt
        honest_ok = False
    median = _median_time(overlapping)
    stall = probe.worst(started, ended)
    report: dict[str, Any] = {
        "name": spec.name,
        "target": spec.target,
        "daemon_alive": alive,
        "honest_ok": honest_ok,
        "honest_slowdown": round(median / baseline_s, 2) if median else None,
        "baseline_s": round(baseline_s, 2),
        "rss_growth_mb": (round(rss_after - rss_before, 1) if rss_after and rss_before else None),
        "loop_stall_ms": round(stall, 1) if stall is not None else None,
        "attack_s": round(ended - started, 1),
        "honest_generations": len(overlapping),
        "detail": detail,
    }
    errors = [g.error for g in overlapping if not g.ok]
    if errors or after is None:
        report["honest_errors"] = errors[:3] or ["no honest generation finished after it"]
    if not alive:
        report["dead"] = [n for n, d in rig.daemons.items() if not d.alive()]
        report["dead_log_tail"] = rig.daemons[report["dead"][0]].log_path.read_text()[-1500:]
    report["held"] = held(report)
    return report


def _leaf(error: BaseException) -> str:
    """The first real error inside (nested) exception groups, and where it was raised."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    at = f" at {where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno}" if where else ""
    return f"{type(error).__name__}: {error}"[:300] + at


def held(report: dict[str, Any]) -> bool:
    """Did the swarm hold this attack within LIMITS (and was the attack made at all)?"""
    if "attack_error" in report["detail"]:
        return False
    if not (report["daemon_alive"] and report["honest_ok"]):
        return False
    for key in ("rss_growth_mb", "loop_stall_ms"):
        if report[key] is None or report[key] > LIMITS[key]:
            return False
    if report["name"] in SLOWDOWN_BOUND_FOR:
        slowdown = report["honest_slowdown"]
        return slowdown is not None and slowdown <= LIMITS["honest_slowdown"]
    return True


async def _connect_nodes(rig: Rig, stack: contextlib.AsyncExitStack, count: int) -> list[Node]:
    nodes = []
    for _ in range(count):
        node = await stack.enter_async_context(
            open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], dht_server=False)
        )
        with trio.fail_after(30):
            await node.connect(parse_peer_maddr(rig.daemons["s0"].maddr))
        nodes.append(node)
    return nodes


async def _run(rig: Rig, specs: list[AttackSpec], baseline_runs: int) -> dict[str, Any]:
    honest = rig.honest = HonestClient(rig.daemons[HONEST].socket, rig.new_tokens)
    with trio.fail_after(GENERATION_LIMIT_S):
        honest.reference = await honest.generate()
    async with contextlib.AsyncExitStack() as stack:
        *rig.attackers, rig.victim = await _connect_nodes(rig, stack, 3)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(honest.run)
            baseline_start = time.monotonic()
            while len([g for g in honest.done if g.ok]) < baseline_runs:
                await trio.sleep(0.1)
                if len(honest.done) > 2 * baseline_runs:
                    raise RuntimeError(f"the swarm fails with no attack: {honest.done[-1].error}")
            baseline_s = _median_time(honest.done)
            assert baseline_s is not None
            quiet_stall = rig.probes[HONEST].worst(baseline_start, time.monotonic())
            attacks = []
            for spec in specs:
                report = await _measure(rig, spec, baseline_s, baseline_runs)
                revived = await trio.to_thread.run_sync(rig.revive)
                if revived:
                    report["restarted"] = revived
                attacks.append(report)
                verdict = "held" if report["held"] else "NOT held"
                print(f"peerd bench attack: {spec.name}: {verdict}", file=sys.stderr, flush=True)
            nursery.cancel_scope.cancel()
    return {
        "model": rig.model,
        "spans": SPANS,
        "honest_new_tokens": rig.new_tokens,
        "baseline_generation_s": round(baseline_s, 2),
        "baseline_loop_stall_ms": quiet_stall,
        "limits": LIMITS,
        "all_held": all(a["held"] for a in attacks),
        "attacks": attacks,
    }


def start_swarm(workdir: Any = None) -> LocalSwarm:
    """The three daemons of SPANS; s0 first (everyone's initial peer), the others side by side."""
    swarm = LocalSwarm(workdir=workdir)
    swarm.start("s0", SPANS["s0"])
    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(swarm.start, n, SPANS[n]) for n in ("s1", "s2")]:
            future.result()
    return swarm


def run_attack_bench(
    *,
    attack_s: float = 8.0,
    new_tokens: int = 8,
    baseline_runs: int = 3,
    only: tuple[str, ...] = (),
    swarm: LocalSwarm | None = None,
) -> dict[str, Any]:
    """Start the swarm (or use `swarm`, as started by start_swarm), run the catalogue (only the
    attacks named in `only`, if given) and report."""
    from peerd.bench.attack_catalogue import CATALOGUE

    specs = [s for s in CATALOGUE if not only or s.name in only]
    unknown = set(only) - {s.name for s in CATALOGUE}
    if unknown:
        names = ", ".join(s.name for s in CATALOGUE)
        raise ValueError(f"no attack called {', '.join(sorted(unknown))}; the attacks: {names}")
    own = swarm is None
    started = time.perf_counter()
    swarm = swarm or start_swarm()
    checkpoint = blocks.resolve_checkpoint("default")
    config = blocks.load_config(checkpoint)
    rig = Rig(
        swarm=swarm,
        daemons={d.name: d for d in swarm.daemons},
        model=blocks.model_name(checkpoint),
        hidden_size=int(config.hidden_size),
        num_blocks=int(config.num_hidden_layers),
        attack_s=attack_s,
        new_tokens=new_tokens,
    )
    try:
        rig.probes = {name: LoopProbe(d) for name, d in rig.daemons.items()}
        for probe in rig.probes.values():
            probe.wait_ready()
        setup_s = time.perf_counter() - started
        report = trio.run(_run, rig, specs, baseline_runs)
        report["setup_s"] = round(setup_s, 1)
        report["total_s"] = round(time.perf_counter() - started, 1)
        return report
    finally:
        for probe in rig.probes.values():
            probe.stop()
        if own:
            swarm.stop()
