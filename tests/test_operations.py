"""Operating a daemon: the systemd unit of `peerd service`, Prometheus metrics, and what the
logs of a daemon that lost a peer look like."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from typer.testing import CliRunner

from blocks.checkpoint import user_cache_dir
from peerd.daemon.main import DRAIN_DEADLINE_S
from peerd.daemon.metrics import Metric, TokenRate, render, serve_metrics
from peerd.daemon.service import (
    ServiceError,
    ServiceSpec,
    exec_start,
    parse_exec_start,
    service_env,
    stop_timeout,
    unit_text,
)
from peerd.devtools.localswarm import LocalSwarm, scrape_metrics
from peerd.session.inference import InferenceSession
from peerd.session.leech import open_leech
from tests.conftest import greedy_continuation

PROMPT = "Once upon a time, there was a little"


def _directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


# --- the unit, as text --------------------------------------------------------------------------


def test_system_unit_restarts_with_backoff_stops_cleanly_and_is_sandboxed() -> None:
    spec = ServiceSpec(("--new-swarm", "--blocks", "0:10"), run_as="peerd")
    d = _directives(unit_text(spec))
    assert d["Restart"] == ["on-failure"] and int(d["RestartSec"][0]) > 0
    assert d["StartLimitBurst"] and d["StartLimitIntervalSec"]
    assert d["RestartPreventExitStatus"] == ["2"]  # a bad flag: restarting would not help
    assert d["KillSignal"] == ["SIGTERM"]
    assert int(d["TimeoutStopSec"][0]) > DRAIN_DEADLINE_S + 5
    assert d["StandardOutput"] == ["journal"] and d["StandardError"] == ["journal"]
    for key in ("NoNewPrivileges", "PrivateTmp"):
        assert d[key] == ["yes"]
    assert d["ProtectSystem"] == ["strict"] and d["ProtectHome"][0] in ("yes", "read-only")
    assert d["StateDirectory"] == d["CacheDirectory"] == d["RuntimeDirectory"] == ["peerd"]
    env = dict(v.split("=", 1) for v in d["Environment"])
    assert env["PEERD_STATE_DIR"] == "%S/peerd"
    assert env["PEERD_CACHE_DIR"] == "%C/peerd"
    assert env["PEERD_RUNTIME_DIR"] == "%t/peerd"
    assert d["User"] == ["peerd"] and d["WantedBy"] == ["multi-user.target"]
    assert d["EnvironmentFile"] == ["-/etc/peerd/peerd.env"]


def test_user_unit_keeps_to_what_a_user_manager_can_do() -> None:
    d = _directives(unit_text(ServiceSpec(("--new-swarm",), user=True, run_as="someone")))
    assert "User" not in d and "ProtectSystem" not in d
    assert d["NoNewPrivileges"] == ["yes"] and d["WantedBy"] == ["default.target"]


def test_exec_start_round_trips_odd_arguments() -> None:
    args = ("--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/X", "--model", "/models/my model 100%$HOME")
    spec = ServiceSpec(args, command=("/opt/peerd/bin/peerd",))
    unit = unit_text(spec)
    assert parse_exec_start(unit) == exec_start(spec)
    assert "%%" in unit and "$$HOME" in unit  # systemd would expand % and $ otherwise


def test_unit_without_a_swarm_is_refused() -> None:
    with pytest.raises(ServiceError, match="--initial-peers"):
        unit_text(ServiceSpec(("--blocks", "auto")))
    assert "--mdns" in unit_text(ServiceSpec(("--mdns", "--swarm", "lab")))  # finds it on the LAN


def test_stop_timeout_follows_the_drain_deadline() -> None:
    assert stop_timeout(()) > DRAIN_DEADLINE_S + 5
    assert stop_timeout(("--drain-timeout", "300")) > 305
    assert stop_timeout(("--drain-timeout=1",)) > 6


def _systemd_analyze() -> str:
    """systemd-analyze, installed with apt-get when missing and possible; skip only if not."""
    found = shutil.which("systemd-analyze")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "install", "-y", "-qq", "systemd"], env=env, check=False,
                       capture_output=True, timeout=300)  # fmt: skip
        found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is missing and cannot be installed here")
    return found


@pytest.mark.parametrize("user", [False, True])
def test_printed_unit_passes_systemd_analyze_verify(tmp_path: Path, user: bool) -> None:
    analyze = _systemd_analyze()
    flags = ["--user"] if user else []
    result = CliRunner().invoke(
        _app(), ["service", "install", "--print", *flags, "--", "--new-swarm", "--blocks", "0:10"]
    )
    assert result.exit_code == 0, result.output
    unit = tmp_path / "peerd.service"
    unit.write_text(result.output)
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))  # a user manager needs one
    verify = subprocess.run(
        [analyze, *flags, "verify", str(unit)], capture_output=True, text=True, env=env
    )
    problems = verify.stdout + verify.stderr
    assert verify.returncode == 0, problems
    assert "Unknown" not in problems and "Invalid" not in problems, problems


def test_install_and_uninstall(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        _app(), ["service", "install", "--unit-dir", str(tmp_path), "--", "--new-swarm"]
    )
    assert result.exit_code == 0, result.output
    unit = (tmp_path / "peerd.service").read_text()
    assert f"EnvironmentFile=-{tmp_path / 'peerd.env'}" in unit
    assert (tmp_path / "peerd.env").stat().st_mode & 0o777 == 0o600
    refused = runner.invoke(_app(), ["service", "install", "--unit-dir", str(tmp_path)])
    assert refused.exit_code == 2 and "--initial-peers" in refused.output
    result = runner.invoke(_app(), ["service", "uninstall", "--unit-dir", str(tmp_path)])
    assert result.exit_code == 0 and not (tmp_path / "peerd.service").exists()
    assert (tmp_path / "peerd.env").exists()  # the operator's settings stay
    if os.geteuid() != 0:
        denied = runner.invoke(_app(), ["service", "install", "--", "--new-swarm"])
        assert denied.exit_code == 2 and "sudo" in denied.output


def _app() -> Any:
    from cli import app

    return app


# --- metrics, in process -----------------------------------------------------------------------


def test_render_is_prometheus_text_format() -> None:
    text = render(
        [
            Metric("peerd_steps_total", "counter", "Steps.").add(3),
            Metric("peerd_errors_total", "counter", "Errors.").add(2, code='bad "x"\n'),
        ]
    )
    assert text.splitlines() == [
        "# HELP peerd_steps_total Steps.",
        "# TYPE peerd_steps_total counter",
        "peerd_steps_total 3",
        "# HELP peerd_errors_total Errors.",
        "# TYPE peerd_errors_total counter",
        'peerd_errors_total{code="bad \\"x\\"\\n"} 2',
    ]


def test_token_rate_over_a_window() -> None:
    rate = TokenRate(window=10)
    assert rate.rate() == 0.0
    for second in range(30):
        rate.record(float(second), 100 * second if second < 20 else 2000)
    assert rate.rate() == pytest.approx(0.0, abs=20)  # idle for the last 10 s
    rate.record(30.0, 2500)
    assert rate.rate() > 0


async def test_metrics_endpoint_answers_get_only() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            serve_metrics, 0, lambda: [Metric("peerd_up", "gauge", "Up.").add(1)]
        )

        async def fetch(request: bytes) -> bytes:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(request)
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
            return data

        ok = await fetch(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200") and b"\r\n\r\npeerd_up 1" in ok.replace(
            b"# HELP peerd_up Up.\n# TYPE peerd_up gauge\n", b""
        )
        assert b"version=0.0.4" in ok
        assert (await fetch(b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404")
        assert (await fetch(b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
        nursery.cancel_scope.cancel()


# --- peerd status --watch ----------------------------------------------------------------------


def _status(states: tuple[str, ...]) -> Any:
    import wire

    swarm = tuple(
        wire.ServerInfo(
            peer_id=f"12D3KooWpeer{i}", model="smollm2", start=10 * i, end=10 * i + 10,
            throughput=20.0, free_cache_tokens=1024, state=state, version="0.1.0",  # type: ignore[arg-type]
        )
        for i, state in enumerate(states)
    )  # fmt: skip
    return wire.StatusResponse(
        peer_id="12D3KooWpeer0", version="0.1.0", uptime_s=12.0, serving=swarm[0],
        swarm=swarm, rtts=(0.002, -1.0, 0.004)[: len(swarm)],
    )  # fmt: skip


def test_status_table_shows_coverage_and_servers() -> None:
    import io

    from rich.console import Console

    from peerd.sdk.terminal import status_table

    out = io.StringIO()
    Console(file=out, width=120).print(status_table(_status(("online", "online", "online"))))
    text = out.getvalue()
    assert "every block is served" in text and "serving blocks 0:10" in text
    assert text.count("direct") == 3 and "2.0" in text and "20:30" in text
    out = io.StringIO()
    Console(file=out, width=120).print(status_table(_status(("online", "draining", "online"))))
    assert "NOT SERVED: 10, 11" in out.getvalue() and "draining" in out.getvalue()


def test_status_watch_refreshes_and_survives_a_missing_daemon() -> None:
    import io

    from peerd.sdk.client import DaemonNotRunning
    from peerd.sdk.terminal import watch_status

    frames = [_status(("online",) * 3), _status(("online", "joining", "online"))]
    replies = iter(frames)

    class FakeClient:
        def status(self) -> Any:
            return next(replies)

        def close(self) -> None:
            pass

    def connect() -> Any:
        if not connected:  # the first refresh finds no daemon
            connected.append(True)
            raise DaemonNotRunning(Path("/nowhere.sock"), "no such file")
        return FakeClient()

    connected: list[bool] = []
    out = io.StringIO()
    watch_status(connect, 0.01, out, count=3, live=False)
    text = out.getvalue()
    assert text.index("no peerd daemon answers") < text.index("every block is served")
    assert text.index("every block is served") < text.index("NOT SERVED: 10")
    # In place (a terminal): the last frame is what stays on screen.
    connected.clear()
    replies = iter(frames)
    out = io.StringIO()
    watch_status(connect, 0.01, out, count=3, live=True)
    assert "NOT SERVED: 10" in out.getvalue()


# --- logging ------------------------------------------------------------------------------------

_LOG_PROBE = """
import logging, sys
import libp2p.network.auto_connector  # sets its own logger to INFO
from peerd.daemon.main import configure_logging
for level in ("info", "debug"):
    configure_logging(level)
    print("== " + level, file=sys.stderr, flush=True)
    logging.getLogger("libp2p.host.basic_host").error("Failed to open stream to X:\\n  Error: y")
    logging.getLogger("libp2p.network.auto_connector").info("AUTO_CONNECTOR_STATE")
    logging.getLogger("peerd.session.swarm").info("servers left the swarm view: X")
    logging.getLogger("peerd.session.swarm").debug("info from X failed")
"""


def test_log_lines_share_one_format_and_libp2p_speaks_only_when_debugging() -> None:
    probe = subprocess.run(
        [sys.executable, "-c", _LOG_PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    _, info, debug = probe.stderr.split("== ")
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: "
    for text in (info, debug):
        lines = [x for x in text.splitlines()[1:] if not x.startswith("  ")]
        assert lines and all(re.match(stamp, line) for line in lines), probe.stderr
        assert "servers left the swarm view" in text
    assert "libp2p.host.basic_host" not in info and "info from X failed" not in info
    assert "AUTO_CONNECTOR" not in info + debug  # libp2p below warning: never
    assert "ERROR libp2p.host.basic_host: Failed" in debug and "info from X failed" in debug


# --- real daemons -------------------------------------------------------------------------------


def _tracebacks(log: Path) -> list[str]:
    text = log.read_text(errors="replace")
    return [text[max(0, i - 200) : i + 1500] for i in [m.start() for m in
            re.finditer("Traceback", text)]]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_metrics_move_during_a_generation() -> None:
    from peerd.sdk.client import Client

    swarm = LocalSwarm()
    try:
        server = swarm.start("x", "0:30", "--metrics-port", "0")
        client_daemon = swarm.start("y", "none", "--metrics-port", "0")
        server_port = server.metrics_port()
        client_port = client_daemon.metrics_port()
        before = scrape_metrics(server_port)
        assert before["peerd_steps_total"] == 0 and before["peerd_sessions_open"] == 0
        assert before["peerd_cache_tokens_free"] > 0
        during: dict[str, float] = {}
        with Client(client_daemon.socket) as client:
            for pieces, _ in enumerate(client.generate(PROMPT, max_new_tokens=24, stream=True)):
                if pieces == 12:
                    during = scrape_metrics(server_port)
        time.sleep(1.2)  # one more tokens/s sample
        after = scrape_metrics(server_port)
        api = scrape_metrics(client_port)
        print(
            f"mid-generation: {during['peerd_sessions_open']:.0f} open session, "
            f"{during['peerd_steps_total']:.0f} steps, "
            f"{during['peerd_cache_tokens_used']:.0f} cache tokens used, "
            f"{after['peerd_tokens_per_second']:.1f} tokens/s over the window"
        )
        assert during["peerd_sessions_open"] == 1
        assert during["peerd_cache_tokens_used"] > 0
        assert 0 < during["peerd_steps_total"] < after["peerd_steps_total"]
        assert after["peerd_sessions_opened_total"] == 1 and after["peerd_sessions_open"] == 0
        assert after["peerd_tokens_served_total"] >= 23 + len(PROMPT.split())
        assert after["peerd_tokens_per_second"] > 0
        assert after["peerd_peers_connected"] >= 1 and after["peerd_peers_known"] >= 1
        assert api["peerd_generations_total"] == 1 and api["peerd_swarm_servers"] == 1
        assert 'peerd_server_state{state="online"}' in after
        watched = subprocess.run(
            [sys.executable, "-m", "cli", "status", "--socket", str(server.socket),
             "--watch", "0.2", "--count", "2"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        assert watched.count("serving blocks 0:30") == 2 and "every block is served" in watched
    finally:
        swarm.stop()


class _UnitProcess:
    """The command line of a unit's ExecStart, run with the unit's environment (systemd's %S,
    %C and %t directories stand in as temp directories), supervised by the test."""

    def __init__(self, unit: str, workdir: Path) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        dirs = {"%S": workdir / "state", "%t": workdir / "run"}
        for key, value in service_env(user=False).items():
            for spec, path in dirs.items():
                value = value.replace(spec, str(path))
            # The model cache: the one this machine already converted (conversion is tested
            # elsewhere and costs seconds).
            env[key] = str(user_cache_dir()) if key == "PEERD_CACHE_DIR" else value
        self.env = env
        self.log = workdir / "unit.log"
        self.output: list[str] = []
        self.exited_after = -1.0
        self.process = subprocess.Popen(
            parse_exec_start(unit), stdout=subprocess.PIPE, stderr=open(self.log, "w"),  # noqa: SIM115
            text=True, cwd=workdir, env=env,
        )  # fmt: skip
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line.rstrip("\n"))
            if line.startswith("listening on "):
                self.ready.set()

    def time_exit(self, since: float) -> None:
        """Note how long after `since` the process exits (in exited_after)."""

        def wait() -> None:
            self.process.wait()
            self.exited_after = time.perf_counter() - since

        threading.Thread(target=wait, daemon=True).start()

    def wait_ready(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"unit did not start:\n{self.log.read_text()[-3000:]}")
        time.sleep(0.2)
        return re.match(r"peerd \S+: peer (\S+)", self.output[0]).group(1)  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_sigterm_to_the_unit_moves_the_generation_to_the_other_server(
    tmp_path: Path, local_model: Any, tokenizer: Any
) -> None:
    """The unit's daemon serves the middle span beside another server; SIGTERM mid-generation
    drains it (deadline 1 s), the client finishes on the other server, the tokens equal local
    greedy, and the daemon exits 0 (so Restart=on-failure leaves it stopped)."""
    ids = tokenizer(PROMPT)["input_ids"]
    reference = greedy_continuation(local_model, tokenizer, PROMPT, 24)
    swarm = LocalSwarm(workdir=tmp_path)
    unit_process: _UnitProcess | None = None
    try:
        swarm.start("a", "0:10")
        start_args = (
            "--blocks", "10:20", "--initial-peers", swarm.initial_peers[0],
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--refresh-period", "2",
            "--torch-threads", "1", "--throughput", "200", "--drain-timeout", "1",
        )  # fmt: skip
        unit = unit_text(ServiceSpec(start_args))
        unit_process = _UnitProcess(unit, tmp_path)
        # b and c start beside the unit's daemon: `a` is everyone's initial peer.
        with ThreadPoolExecutor(max_workers=2) as pool:
            # b announces 2 tokens/s (the unit 200): the route takes the unit until it drains
            # (CI once routed through b from the start, and the SIGTERM had nothing to move).
            other_start = pool.submit(swarm.start, "b", "10:20", "--throughput", "2")
            pool.submit(swarm.start, "c", "20:30").result()
            other = other_start.result()
        unit_peer = await trio.to_thread.run_sync(unit_process.wait_ready)
        state = tmp_path / "state" / "peerd"
        assert (state / "identity.key").exists()  # identity under StateDirectory
        assert (tmp_path / "run" / "peerd" / "peerd.sock").exists()  # socket under Runtime...
        async with open_leech("default", swarm.initial_peers, refresh_period=2.0) as leech:
            with trio.fail_after(30):
                while unit_peer not in leech.swarm.records:
                    await trio.sleep(0.2)
            tokens: list[int] = []
            middles: list[str] = []
            signalled_at = 0.0
            prompt = torch.tensor([ids])
            # 16 tokens after SIGTERM, each at least 0.1 s: the 1 s drain deadline passes.
            async with InferenceSession(leech.swarm, max_length=len(ids) + 24) as session:
                async for token in leech.generator.generate(prompt, 24, session=session):
                    tokens.append(int(token[0, 0]))
                    middles.append(next(h.peer_id for h in session.hops if h.hop.start == 10))
                    if len(tokens) == 8:
                        assert middles[-1] == unit_peer, "the unit's daemon was not on the route"
                        unit_process.process.send_signal(signal.SIGTERM)
                        signalled_at = time.perf_counter()
                        unit_process.time_exit(signalled_at)
                    elif signalled_at:
                        await trio.sleep(0.1)  # a slow reader: the drain deadline passes
        exit_code = await trio.to_thread.run_sync(lambda: unit_process.process.wait(60))
        stopped_after = unit_process.exited_after
        moved_at = middles.index(other.peer_id)
        print(
            f"SIGTERM at token 8; token {moved_at + 1} came from the other server; "
            f"the unit's daemon exited {exit_code} {stopped_after:.1f} s after SIGTERM"
        )
        assert tokens == reference
        assert middles[-1] == other.peer_id and moved_at > 8
        assert exit_code == 0
        assert not (tmp_path / "run" / "peerd" / "peerd.sock").exists()
        # Expected conditions (a server drained, a peer went away) leave no tracebacks.
        for log in [unit_process.log, *(d.log_path for d in swarm.daemons)]:
            assert not _tracebacks(log), f"{log.name}:\n" + "\n".join(_tracebacks(log))
    finally:
        if unit_process is not None and unit_process.process.poll() is None:
            unit_process.process.kill()
        swarm.stop()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mdns_daemons_find_each_other_and_other_swarms_stay_apart(tmp_path: Path) -> None:
    """Two daemons of swarm `lab` with --mdns and no initial peers serve a generation together;
    a daemon of swarm `other` on the same LAN, serving the same blocks faster, is never used."""
    from peerd.devtools.localswarm import DaemonProcess
    from peerd.sdk.client import Client

    tag = os.urandom(4).hex()  # other test runs on this LAN must not share our swarm names

    def daemon(name: str, blocks: str, swarm: str, throughput: str) -> DaemonProcess:
        args = ["--blocks", blocks, "--mdns", "--swarm", f"{swarm}-{tag}", "--refresh-period",
                "2", "--torch-threads", "1", "--throughput", throughput]  # fmt: skip
        files = {k: tmp_path / f"{name}.{ext}" for k, ext in
                 [("identity", "key"), ("log_path", "log"), ("socket", "sock")]}  # fmt: skip
        return DaemonProcess(name=name, args=args, **files)

    daemons = [
        daemon("other", "15:30", "other", "200"),
        daemon("x", "0:15", "lab", "20"),
        daemon("y", "15:30", "lab", "20"),
    ]
    try:
        for d in daemons:
            d.start()
        started = time.perf_counter()  # y, the last, is up
        other, x, y = daemons
        with Client(x.socket) as client:
            deadline = time.monotonic() + 60
            while {s.peer_id for s in client.status().swarm} != {x.peer_id, y.peer_id}:
                assert time.monotonic() < deadline, client.status().swarm
                time.sleep(0.5)
            found = time.perf_counter() - started
            answer = client.generate_full(PROMPT, max_new_tokens=8)
            seen = {s.peer_id for s in client.status().swarm}
        with Client(y.socket) as client:
            served = client.status().steps_served
        with Client(other.socket) as client:
            other_status = client.status()
        print(f"x saw y {found:.1f} s after y was up (both found on the LAN by mDNS)")
        assert len(answer.token_ids) == 8 and served > 0
        assert other.peer_id not in seen
        assert other_status.steps_served == 0
        assert {s.peer_id for s in other_status.swarm} == {other.peer_id}
        for d in daemons:
            assert not _tracebacks(d.log_path), d.log_path.read_text()[-3000:]
    finally:
        for d in daemons:
            d.kill()
