"""peerd.devtools.localswarm without daemons: waiting for one to go online, and the workdir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from peerd.devtools.localswarm import DaemonProcess, LocalSwarm


def _process(tmp_path: Path, script: str) -> DaemonProcess:
    """A DaemonProcess whose process is `script` run by Python, writing to its log."""
    log = tmp_path / "d.log"
    log.touch()  # as DaemonProcess.start opens it before the process starts
    daemon = DaemonProcess(
        name="d", args=[], identity=tmp_path / "d.key", log_path=log, socket=tmp_path / "d.sock"
    )
    daemon.process = subprocess.Popen([sys.executable, "-c", script, str(log)], text=True)
    return daemon


def test_wait_online_returns_once_the_log_says_so(tmp_path: Path) -> None:
    daemon = _process(
        tmp_path,
        "import sys, time; p = sys.argv[1]; open(p, 'a').write('loading\\n'); time.sleep(0.5);"
        " open(p, 'a').write('online: blocks 0:10\\n'); time.sleep(30)",
    )
    try:
        daemon.wait_online(timeout=20)
        assert "online: blocks" in daemon.log_path.read_text()
        assert daemon.alive()
    finally:
        daemon.kill()


def test_wait_online_fails_when_the_daemon_ends_first(tmp_path: Path) -> None:
    daemon = _process(tmp_path, "import sys; open(sys.argv[1], 'a').write('failed\\n')")
    with pytest.raises(RuntimeError, match="ended before going online"):
        daemon.wait_online(timeout=20)


def test_wait_online_gives_up_after_its_timeout(tmp_path: Path) -> None:
    daemon = _process(tmp_path, "import sys, time; open(sys.argv[1], 'a'); time.sleep(30)")
    try:
        with pytest.raises(RuntimeError, match="not online within"):
            daemon.wait_online(timeout=0.5)
    finally:
        daemon.kill()


def test_stop_removes_only_a_workdir_of_its_own(tmp_path: Path) -> None:
    own = LocalSwarm()
    assert own.workdir.is_dir()
    (own.workdir / "a.log").write_text("log")
    own.stop()
    assert not own.workdir.exists()
    given = LocalSwarm(workdir=tmp_path)
    (tmp_path / "a.log").write_text("log")
    given.stop()
    assert (tmp_path / "a.log").read_text() == "log"
