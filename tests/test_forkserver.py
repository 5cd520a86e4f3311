"""The fork server the multi-process tests start their daemons from: a forked daemon is a process
of its own that the test waits for and signals as a Popen, with its own output and log."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from peerd.devtools import forkserver
from peerd.devtools.localswarm import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _spawn(args: list[str], log_path: Path) -> forkserver.ForkedProcess:
    with open(log_path, "a") as log:
        return forkserver.spawn(args, log, ROOT)


def test_a_forked_cli_gives_its_output_log_and_exit_status(tmp_path: Path) -> None:
    helped = _spawn(["start", "--help"], tmp_path / "help.log")
    assert helped.wait(60) == 0
    assert "--blocks" in helped.stdout.read()

    refused = _spawn(["start", "--blocks", "0:1"], tmp_path / "bad.log")  # no swarm to join
    assert refused.wait(60) == 2
    assert refused.stdout.read() == ""
    assert "--new-swarm" in (tmp_path / "bad.log").read_text()  # the error, in its own log


def test_a_forked_daemon_is_ours_to_signal_and_wait_for(tmp_path: Path) -> None:
    daemon = _spawn(
        ["start", "--new-swarm", "--blocks", "none", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--identity", str(tmp_path / "id.key"), "--socket", str(tmp_path / "d.sock")],
        tmp_path / "d.log",
    )  # fmt: skip
    try:
        lines = iter(daemon.stdout)
        assert any(line.startswith("listening on ") for line in lines)
        assert daemon.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            daemon.wait(0.1)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0  # a clean shutdown, as `peerd start` exits on SIGTERM
    finally:
        daemon.kill()
    other = _spawn(
        ["start", "--new-swarm", "--blocks", "none", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--identity", str(tmp_path / "id2.key"), "--socket", str(tmp_path / "d2.sock")],
        tmp_path / "d2.log",
    )  # fmt: skip
    assert any(line.startswith("listening on ") for line in other.stdout)
    other.kill()
    assert other.wait(10) == -signal.SIGKILL
    assert other.pid != daemon.pid
