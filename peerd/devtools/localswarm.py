"""A swarm of real `peerd start` daemons as separate processes on 127.0.0.1, for `peerd demo`,
the benchmarks and the multi-process tests, stopped however the caller needs (SIGTERM, kill -9)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from peerd.devtools import forkserver
from peerd.devtools.forkserver import ForkedProcess
from peerd.devtools.netns import Host

ROOT = Path(__file__).resolve().parents[2]  # the repository: `python -m cli` runs there
# Daemons forked from a process that has imported them (peerd.devtools.forkserver): the tests
# turn this on; benchmarks and `peerd demo` start each daemon as its own `python -m cli`.
_fork = False


def use_fork_server(on: bool = True) -> None:
    """Start daemons as forks of one warm process (peerd.devtools.forkserver): ~10 s less each
    on a slow 2-core machine. Off: shut it down."""
    global _fork
    _fork = on
    if not on:
        forkserver.shutdown()


@dataclass
class DaemonProcess:
    name: str
    args: list[str]
    identity: Path
    log_path: Path
    socket: Path
    process: subprocess.Popen[str] | ForkedProcess | None = None
    peer_id: str = ""
    maddrs: list[str] = field(default_factory=list)
    span: tuple[int, int] | None = None
    output: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the daemon
    # Command prefix that runs the daemon elsewhere, e.g. `ip netns exec NS` (peerd.devtools.netns).
    launcher: list[str] = field(default_factory=list)
    netns: str | None = None  # the network namespace `launcher` enters, if that is all it does

    @property
    def maddr(self) -> str:
        """Its first direct listen address (127.0.0.1 unless it runs in a namespace)."""
        return next(a for a in self.maddrs if "/p2p-circuit" not in a)

    def start(self, timeout: float = 180.0) -> DaemonProcess:
        log = open(self.log_path, "a")  # noqa: SIM115 (closed when the process ends)
        args = ["start", *self.args, *self._own_files()]
        if _fork and forkserver.can_fork(self.env) and (not self.launcher or self.netns):
            self.process = forkserver.spawn(args, log, ROOT, env=self.env, netns=self.netns)
        else:
            self.process = subprocess.Popen(
                [*self.launcher, sys.executable, "-m", "cli", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ROOT,
                env=forkserver.daemon_env(self.env),
            )
        ready = threading.Event()

        def read_banner() -> None:
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                self.output.append(line.rstrip("\n"))
                if m := re.match(r"peerd \S+: peer (\S+)", line):
                    self.peer_id = m.group(1)
                elif m := re.match(r"serving blocks (\d+):(\d+)", line):
                    self.span = (int(m.group(1)), int(m.group(2)))
                elif line.startswith("listening on "):
                    self.maddrs.append(line.split()[-1])
                    ready.set()

        threading.Thread(target=read_banner, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"daemon {self.name} did not start (exit {self.process.poll()}):\n"
                    + self.log_path.read_text()[-3000:]
                )
        time.sleep(0.2)  # let the remaining banner lines arrive
        return self

    def wait_online(self, timeout: float = 180.0) -> None:
        """Until the daemon serves its span (loaded, tuned, throughput measured): benches start
        the next daemon only then, so no two time their forms (blocks.skinny) at once."""
        deadline = time.monotonic() + timeout
        while "online: blocks" not in self.log_path.read_text():
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"daemon {self.name} ended before going online")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon {self.name} not online within {timeout:.0f} s")
            time.sleep(0.2)

    def _own_files(self) -> list[str]:
        return ["--identity", str(self.identity), "--socket", str(self.socket)]

    def kill(self) -> None:
        """kill -9: no goodbye, the peer just vanishes."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def terminate(self, timeout: float = 60.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def metrics_port(self) -> int:
        """The port of its Prometheus /metrics (started with --metrics-port), from its banner."""
        for line in self.output:
            if m := re.match(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line):
                return int(m.group(1))
        raise RuntimeError(f"daemon {self.name} printed no metrics address: {self.output}")


def scrape_metrics(port: int, timeout: float = 30.0) -> dict[str, float]:
    """One scrape of a daemon's /metrics: `name{labels}` -> value."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return parse_metrics(reply.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as `name{labels}` -> value."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


class LocalSwarm:
    """Daemons of one test; the first one started with --new-swarm is everyone's initial peer."""

    def __init__(
        self,
        workdir: Path | None = None,
        refresh_period: float = 2.0,
        torch_threads: int = 1,
        throughput: str = "20",
    ) -> None:
        # A workdir of its own (none given) goes when the swarm stops; a given one is the caller's.
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="peerd-swarm-"))
        self.refresh_period = refresh_period
        # Tests pass a fixed throughput: measuring it costs seconds per daemon and the planner
        # only compares servers of one test with each other.
        self.torch_threads = torch_threads
        self.throughput = throughput
        self.daemons: list[DaemonProcess] = []

    @property
    def initial_peers(self) -> list[str]:
        return [self.daemons[0].maddr] if self.daemons else []

    def start(
        self,
        name: str,
        blocks: str,
        *extra: str,
        identity: str | None = None,
        env: dict[str, str] | None = None,
        host: Host | None = None,
        online: bool = False,
    ) -> DaemonProcess:
        """Start a daemon; with `host` (peerd.devtools.netns), inside that host's network
        namespace; with `online`, return once it serves its span (DaemonProcess.wait_online)."""
        peers = self.initial_peers
        join = ["--initial-peers", peers[0]] if peers else ["--new-swarm"]
        args = [
            "--blocks",
            blocks,
            *join,
            "--host-maddrs",
            f"/ip4/{host.ip if host else '127.0.0.1'}/tcp/0",
            "--refresh-period",
            str(self.refresh_period),
            "--torch-threads",
            str(self.torch_threads),
            "--throughput",
            self.throughput,
            *extra,
        ]
        daemon = DaemonProcess(
            name=name,
            args=args,
            identity=self.workdir / f"{identity or name}.key",
            socket=self.workdir / f"{name}.sock",
            log_path=self.workdir / f"{name}.log",
            env=env or {},
            launcher=host.exec_args() if host else [],
            netns=host.netns if host else None,
        )
        self.daemons.append(daemon)
        daemon.start()
        if online:
            daemon.wait_online()
        return daemon

    def stop(self) -> None:
        for daemon in self.daemons:
            daemon.kill()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
