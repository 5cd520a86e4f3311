"""A LAN of four machines (peerd.devtools.netns, no NAT) joined as a person joins one: the first
daemon starts a swarm, and each of the others is started with the join command the first one's
banner prints, as it prints it. They listen on every interface, so the banner and `peerd status`
must give addresses another machine can dial. The swarm answers a greedy generation as
transformers does; at the production refresh period a new server is in every other daemon's view
at once (it told them), and one stopped with SIGTERM is out of them at once."""

from __future__ import annotations

import concurrent.futures
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from peerd.devtools import netns
from peerd.devtools.localswarm import ROOT, DaemonProcess
from peerd.devtools.netns import Host
from peerd.sdk.client import Client
from tests.conftest import greedy_continuation

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.multiprocess]

PROMPT = "The capital of France is"
SPANS = ("0:8", "8:16", "16:23", "23:30")
# A server's refresh comes every 48-60 s at the production period (60 s, jittered): anything
# seen well within this was told, not found by a refresh. The issue asks for 5 s; this is the
# limit a loaded 2-core CI machine gets (the measured times are printed).
TOLD_WITHIN_S = 15.0


@pytest.fixture
def lan() -> Iterator[list[Host]]:
    try:
        netns.check_available()
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))
    with netns.topology() as topo:
        yield [topo.add_public(f"lan{i}") for i in range(len(SPANS))]


def _daemon(workdir: Path, host: Host, blocks: str, join: list[str], *extra: str) -> DaemonProcess:
    """A daemon on `host` listening on every interface (no --host-maddrs), at the production
    refresh period (no --refresh-period)."""
    args = [*join, "--blocks", blocks, "--throughput", "20", "--torch-threads", "1", *extra]
    return DaemonProcess(
        name=host.name,
        args=args,
        identity=workdir / f"{host.name}.key",
        socket=workdir / f"{host.name}.sock",
        log_path=workdir / f"{host.name}.log",
        launcher=host.exec_args(),
    ).start()


def _join_args(banner: list[str]) -> list[str]:
    """The arguments of the join command in a banner, as a person copies it."""
    line = next(line for line in banner if line.startswith("join from another machine: "))
    argv = shlex.split(line.split(": ", 1)[1])
    assert argv[:2] == ["peerd", "start"], line
    return argv[2:]


def _peers_seen(daemon: DaemonProcess) -> set[str]:
    with Client(daemon.socket) as client:
        return {info.peer_id for info in client.status().swarm}


def _seconds_until(holds: Callable[[], bool], limit: float) -> float:
    started = time.monotonic()
    while not holds():
        if time.monotonic() - started > limit:
            return float("inf")
        time.sleep(0.1)
    return time.monotonic() - started


def _status_text(daemon: DaemonProcess, host: Host) -> str:
    done = subprocess.run(
        [*host.exec_args(), sys.executable, "-m", "cli", "status", "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_lan_joins_by_the_banners_command_and_sees_joins_and_leaves_at_once(
    lan: list[Host], local_model: Any, tokenizer: Any
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="peerd-lan-"))
    daemons: list[DaemonProcess] = []
    try:
        daemons.append(_daemon(workdir, lan[0], SPANS[0], ["--new-swarm"]))
        join = _join_args(daemons[0].output)
        # The address to join through is the first host's own, not 0.0.0.0 nor loopback.
        assert join[:2] == ["--initial-peers", daemons[0].maddr], daemons[0].output
        assert f"/ip4/{lan[0].ip}/tcp/" in join[1]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = [
                pool.submit(_daemon, workdir, lan[1], SPANS[1], join, "--public-name", "attic GPU"),
                pool.submit(_daemon, workdir, lan[2], SPANS[2], join),
            ]
            daemons += [f.result() for f in started]
        newcomer = _daemon(workdir, lan[3], SPANS[3], join)
        banner_at = time.monotonic()
        daemons.append(newcomer)
        others = daemons[:3]
        seen_after = [
            _seconds_until(lambda d=d: newcomer.peer_id in _peers_seen(d), TOLD_WITHIN_S)
            for d in others
        ]
        print(
            f"new server seen {time.monotonic() - banner_at:.1f} s after its banner: {seen_after}"
        )
        assert max(seen_after) < TOLD_WITHIN_S, seen_after
        for d in others:  # it told them: no refresh found it
            assert f"server {newcomer.peer_id} joined" in d.log_path.read_text(), d.name

        expected = tokenizer.decode(greedy_continuation(local_model, tokenizer, PROMPT, 6))
        with Client(daemons[0].socket) as client:
            assert client.generate(PROMPT, max_new_tokens=6) == expected

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(_status_text, daemons, lan))
        for text, host in zip(texts, lan, strict=True):
            for daemon, where in zip(daemons, lan, strict=True):
                # Every server, by its address on its own machine: dialable from this one.
                dialable = rf"/ip4/{re.escape(where.ip)}/tcp/\d+/p2p/{daemon.peer_id}"
                assert re.search(dialable, text), (host.name, daemon.name, text)
            assert "0.0.0.0" not in text and "every block is served" in text, text
            assert host is lan[1] or "(attic GPU)" in text, text

        newcomer.process.send_signal(15)  # type: ignore[union-attr]
        gone_after = [
            _seconds_until(lambda d=d: newcomer.peer_id not in _peers_seen(d), TOLD_WITHIN_S)
            for d in others
        ]
        print(f"SIGTERM'd server gone from the others' views after {gone_after} s")
        assert max(gone_after) < TOLD_WITHIN_S, gone_after
        for d in others:
            assert f"server {newcomer.peer_id} left the swarm" in d.log_path.read_text(), d.name
    finally:
        for daemon in daemons:
            daemon.kill()
