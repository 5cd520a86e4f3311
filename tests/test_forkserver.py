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


def _spawn(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> forkserver.ForkedProcess:
    with open(log_path, "a") as log:
        return forkserver.spawn(args, log, ROOT, env=env)


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


def test_only_peerds_own_variables_go_to_a_forked_daemon(tmp_path: Path) -> None:
    """Variables an import reads (before the fork) would be the fork server's, not the daemon's:
    such a daemon starts as a plain process."""
    assert forkserver.can_fork({}) and forkserver.can_fork({"PEERD_STATE_DIR": "/x"})
    assert not forkserver.can_fork({"PEERD_STATE_DIR": "/x", "HF_HOME": "/y"})
    with pytest.raises(ValueError, match="PEERD_"):
        _spawn(["start", "--help"], tmp_path / "log", env={"TRANSFORMERS_CACHE": "/y"})
