"""The real half of `peerd bench scale --real` (peerd.bench.scale_real): the plan's servers as
daemons of a tiny random model, each in a network namespace whose link delays what it receives
by its host's delay, started on the spans the simulated servers chose and with the identities
and throughputs they had; then each client daemon in turn, on a host of its own, until its
first route (its discovery metrics), the route it plans for a session, and that route's cost
against the offline optimum over every server's live record with the true round trips.

Daemons are forks of one warm process (peerd.devtools.forkserver): ~2 s a start instead of ~10.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peerd.bench.scale_real import (
    CLIENT_REFRESH_S,
    FIRST_ROUTE_FIGURES,
    FIRST_ROUTE_METRIC,
    FIRST_ROUTE_TIMEOUT_S,
    RATE_MBIT,
    REFRESH_PERIOD_S,
    SETTLE_S,
    Plan,
    build_tiny_model,
    metric,
    parse_route,
    scrape_in,
    tcp_rtts,
)
from routing.records import SwarmSnapshot, info_to_record
from routing.simulate_client import cost_vs_optimum

if TYPE_CHECKING:
    from peerd.devtools.localswarm import DaemonProcess, LocalSwarm
    from peerd.devtools.netns import Host, Topology

Say = Callable[[str], None]
# A daemon that shows no discovery metric at all this long after it started predates them.
NO_METRICS_AFTER_S = 20.0
SESSION_LENGTH = 16
NO_DISCOVERY_METRICS = (
    "the client daemons expose no peerd_discovery_* metrics: they predate discovery at scale "
    "(peerd/session/directory.py), so first-route time and messages per look-up were not "
    "measured on the real swarm (route cost was)"
)


def run_real(
    plan: Plan,
    spans: list[list[int] | None],
    workdir: Path,
    say: Say,
    settle_s: float = SETTLE_S,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Start the swarm, let it settle `settle_s`, measure each client in turn, stop everything;
    per client its figures, and notes on what could not be measured."""
    from peerd.devtools.localswarm import LocalSwarm, use_fork_server
    from peerd.devtools.netns import topology

    if any(span is None for span in spans) or len(spans) != len(plan.servers):
        raise ValueError(f"the simulated servers left spans unchosen: {spans}")
    model = build_tiny_model(workdir / "tiny-scale", plan.num_blocks)
    notes: list[str] = []
    use_fork_server(True)
    swarm = LocalSwarm(workdir, refresh_period=REFRESH_PERIOD_S)
    try:
        with topology() as topo:
            try:
                hosts = _hosts(topo, plan)
                started = time.monotonic()
                servers = _start_servers(swarm, hosts, plan, spans, model, say)
                say(f"{len(servers)} servers up in {time.monotonic() - started:.0f} s; settling")
                idle = _cpu_seconds(swarm.daemons), time.monotonic()
                time.sleep(settle_s)
                notes.append(_idle_note(swarm.daemons, *idle))
                truth = _truth(swarm.daemons, plan.num_blocks, spans, notes)
                clients = []
                for i, delay in enumerate(plan.client_delays_s):
                    client = Client(swarm, hosts[f"c{i}"], model, delay)
                    clients.append(client.measure(truth, servers, notes, say))
                notes.append(_memory_note(swarm.daemons))
            finally:
                swarm.stop()
    finally:
        use_fork_server(False)
    return clients, list(dict.fromkeys(notes))


def _hosts(topo: Topology, plan: Plan) -> dict[str, Host]:
    """A public host per server (s00, s01, ...) and per client (c0, c1, ...), each link
    delaying what its host receives by the host's delay."""
    hosts = {}
    named = [(f"s{i:02d}", d) for i, d in enumerate(plan.server_delays_s)]
    named += [(f"c{i}", d) for i, d in enumerate(plan.client_delays_s)]
    for name, delay in named:
        hosts[name] = topo.add_public(name)
        topo.shape(hosts[name], delay * 1000, RATE_MBIT)
    return hosts


def _start_servers(
    swarm: LocalSwarm,
    hosts: dict[str, Host],
    plan: Plan,
    spans: list[list[int] | None],
    model: Path,
    say: Say,
) -> dict[str, Server]:
    """Each server on its span, with its identity and throughput; by peer id, its host's delay
    and listen address."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    servers = {}
    for i, (spec, span) in enumerate(zip(plan.servers, spans, strict=True)):
        assert span is not None
        name = f"s{i:02d}"
        identity = swarm.workdir / f"{name}.key"
        identity.write_bytes(spec.seed)
        identity.chmod(0o600)
        blocks = f"{span[0]}:{span[1]}"
        args = ("--model", str(model), "--throughput", f"{spec.throughput:.6g}")
        daemon = swarm.start(name, blocks, *args, host=hosts[name])
        expected = ID.from_pubkey(create_new_key_pair(spec.seed).public_key).to_base58()
        if daemon.peer_id != expected:
            raise RuntimeError(f"daemon {name} is {daemon.peer_id}, not {expected} (its seed)")
        _, _, ip, _, port = daemon.maddr.split("/")[:5]
        servers[daemon.peer_id] = Server(plan.server_delays_s[i], (ip, int(port)))
        if (i + 1) % 6 == 0:
            say(f"{i + 1} of {len(plan.servers)} servers started")
    return servers


def _truth(
    daemons: list[DaemonProcess], num_blocks: int, spans: list[list[int] | None], notes: list[str]
) -> SwarmSnapshot:
    """Every server's live record, as it answers `peerd status` (what it serves right now)."""
    from peerd.sdk.client import Client as SdkClient

    records = []
    for daemon, span in zip(daemons, spans, strict=True):
        with SdkClient(daemon.socket, timeout=30) as sdk:
            serving = sdk.status().serving
        if serving is None:
            raise RuntimeError(f"server daemon {daemon.name} serves nothing")
        record = info_to_record(serving)
        if span is not None and list(record.span) != span:
            notes.append(f"{daemon.name} serves {record.span}, planned {tuple(span)}")
        records.append(record)
    return SwarmSnapshot(records[0].model, num_blocks, tuple(records))


def _memory_note(daemons: list[DaemonProcess]) -> str:
    """The daemons' resident memory, summed (forks share their parent's pages: an upper bound)."""
    import psutil

    total = alive = 0
    for daemon in daemons:
        if daemon.process is not None and daemon.alive():
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(daemon.process.pid).memory_info().rss
                alive += 1
    return f"{alive} server daemons held {total / 2**30:.1f} GiB resident (shared pages counted)"


def _cpu_seconds(daemons: list[DaemonProcess]) -> float:
    """CPU seconds (user + system, all threads) the live daemons have used."""
    import psutil

    total = 0.0
    for daemon in daemons:
        if daemon.process is not None and daemon.alive():
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(daemon.process.pid).cpu_times()
                total += times.user + times.system
    return total


def _idle_note(daemons: list[DaemonProcess], cpu_before: float, since: float) -> str:
    """What the idle swarm cost while it settled: the cores its daemons kept busy."""
    cores = (_cpu_seconds(daemons) - cpu_before) / (time.monotonic() - since)
    return (
        f"while settling, the {len(daemons)} idle servers kept {cores:.2f} cores busy "
        f"({100 * cores / len(daemons):.1f}% of a core each; load average "
        f"{os.getloadavg()[0]:.1f})"
    )


class Client:
    """One client daemon on its host: started, measured, killed."""

    def __init__(self, swarm: LocalSwarm, host: Host, model: Path, delay_s: float) -> None:
        self.swarm, self.host, self.model, self.delay_s = swarm, host, model, delay_s

    def measure(
        self, truth: SwarmSnapshot, servers: dict[str, Server], notes: list[str], say: Say
    ) -> dict[str, Any]:
        """Its first route's figures, the route it plans and that route's cost ratio; what
        failed instead, if it found no route."""
        args = ["--model", str(self.model), "--metrics-port", "0"]
        args += ["--refresh-period", str(CLIENT_REFRESH_S)]
        idle_load = round(os.getloadavg()[0], 2)  # the swarm's own, before the client starts
        daemon = self.swarm.start(self.host.name, "none", *args, host=self.host)
        try:
            figures = self._first_route(daemon)
            if figures is None:
                notes.append(NO_DISCOVERY_METRICS)
                figures = {}
            figures["load_average"] = (idle_load, round(os.getloadavg()[0], 2))
            hops = self._route(daemon)
            rtts = {peer: Plan.rtt(self.delay_s, s.delay_s) for peer, s in servers.items()}
            figures["route"] = list(hops)
            figures["cost_ratio"] = round(cost_vs_optimum(parse_route(hops, truth), truth, rtts), 4)
            tcp = tcp_rtts(self.host.netns, [s.address for s in servers.values()])
            figures["tcp_rtt_over_model"] = _median(
                [t / r for t, r in zip(tcp, rtts.values(), strict=True)]
            )
            figures["info_rtt_over_model"] = self._info_rtts(daemon, rtts)
            figures["delay_ms"] = round(self.delay_s * 1000, 2)
        except NoRoute as e:
            figures = {"failed": str(e)}
        finally:
            daemon.kill()
        say(f"client {daemon.name}: {figures}")
        return figures

    def _first_route(self, daemon: DaemonProcess) -> dict[str, Any] | None:
        """The discovery metrics once the first route is in; None if the daemon has none."""
        port, started = daemon.metrics_port(), time.monotonic()
        while True:
            values = scrape_in(self.host.netns, port)
            first = metric(values, FIRST_ROUTE_METRIC)
            if first:
                figures = {k: metric(values, name) for k, name in FIRST_ROUTE_FIGURES.items()}
                return {"first_route_s": round(first, 4), **figures}
            waited = time.monotonic() - started
            if waited > NO_METRICS_AFTER_S and not any(
                key.startswith("peerd_discovery_") for key in values
            ):
                return None
            if waited > FIRST_ROUTE_TIMEOUT_S:
                raise NoRoute(
                    f"client {daemon.name} found no route in {FIRST_ROUTE_TIMEOUT_S:g} s "
                    f"(load average {os.getloadavg()[0]:.1f}); its log ends:\n"
                    + daemon.log_path.read_text()[-1500:]
                )
            time.sleep(1.0)

    def _route(self, daemon: DaemonProcess) -> tuple[str, ...]:
        """The hops of an inference session the client daemon opens (and closes)."""
        from peerd.sdk.client import Client as SdkClient
        from peerd.sdk.client import PeerdError

        deadline = time.monotonic() + FIRST_ROUTE_TIMEOUT_S
        while True:
            try:
                with SdkClient(daemon.socket, timeout=60) as sdk:
                    session = sdk.open_session(SESSION_LENGTH)
                    hops = sdk.last_route
                    sdk.close_session(session)
                return hops
            except PeerdError as e:
                if time.monotonic() > deadline:
                    raise NoRoute(f"client {daemon.name} opened no session: {e}") from None
                time.sleep(0.5)

    def _info_rtts(self, daemon: DaemonProcess, rtts: dict[str, float]) -> float | None:
        """The median, over the servers the client measured, of the round trip it measured
        (its `info` calls, smoothed: a stream's negotiation and the daemons' work included) over
        the modelled one."""
        from peerd.sdk.client import Client as SdkClient

        with SdkClient(daemon.socket, timeout=30) as sdk:
            status = sdk.status()
        ratios = [
            rtt / rtts[info.peer_id]
            for info, rtt in zip(status.swarm, status.rtts, strict=False)
            if rtt > 0 and info.peer_id in rtts
        ]
        return _median(ratios)


class NoRoute(RuntimeError):
    """A client daemon found no route in time."""


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


@dataclass(frozen=True)
class Server:
    """A server daemon as a client's measurement needs it: its host's delay, where it listens."""

    delay_s: float
    address: tuple[str, int]
