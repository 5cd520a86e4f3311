"""Several daemons on one machine: each gets an identity of its own (derived from its socket), a
second daemon on an identity or socket that is in use is refused at once in one line (exit 2),
before any weights load, and what goes wrong for reasons outside our code (a port in use) is one
line too, never a traceback through the daemon's nurseries."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import blocks
from peerd.daemon import startup
from peerd.daemon.main import DaemonConfig, DaemonError, run
from peerd.devtools.localswarm import ROOT, DaemonProcess, LocalSwarm
from peerd.node.identity import IdentityInUse, hold_identity, peer_id_of
from peerd.sdk.client import Client


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state and a runtime dir of this test's own (identities, default socket)."""
    monkeypatch.setenv("PEERD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("PEERD_RUNTIME_DIR", str(tmp_path / "run"))
    return tmp_path


@pytest.fixture
def busy_socket(tmp_path: Path) -> Iterator[Path]:
    """A Unix socket something listens on, as a running daemon's is."""
    path = tmp_path / "busy.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    try:
        yield path
    finally:
        listener.close()


def test_each_socket_has_its_own_identity_and_the_default_keeps_the_old_one(dirs: Path) -> None:
    state = dirs / "state"
    assert startup.identity_for_socket(dirs / "run" / "peerd.sock") == state / "identity.key"
    a = startup.identity_for_socket(dirs / "a.sock")
    b = startup.identity_for_socket(dirs / "b.sock")
    elsewhere = startup.identity_for_socket(dirs / "other" / "a.sock")
    assert len({a, b, elsewhere, state / "identity.key"}) == 4
    assert a.parent == state and a.name.startswith("identity-a-")
    assert startup.identity_for_socket(dirs / "a.sock") == a  # the same at every restart


def test_a_held_identity_is_refused_to_a_second_holder_until_released(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    with hold_identity(path) as first:
        with pytest.raises(IdentityInUse):
            hold_identity(path)
        # flock is per open file: a second daemon process is refused the same way.
        other = subprocess.run(
            [sys.executable, "-c", "import sys; from pathlib import Path; "
             "from peerd.node.identity import hold_identity; hold_identity(Path(sys.argv[1]))",
             str(path)],
            capture_output=True, text=True, cwd=ROOT, timeout=300,
        )  # fmt: skip
        assert other.returncode != 0 and "IdentityInUse" in other.stderr
    with hold_identity(path) as again:  # released: the same peer id again
        assert peer_id_of(again.key_pair) == peer_id_of(first.key_pair)


def test_an_identity_in_use_is_refused_naming_the_flag_to_give(dirs: Path) -> None:
    taken = dirs / "state" / "identity.key"
    with hold_identity(taken):
        with pytest.raises(startup.ClaimError) as refused:
            startup.claim_identity(taken, dirs / "b.sock")
        derived = startup.identity_for_socket(dirs / "b.sock")
        assert f"give this one --identity {derived}" in str(refused.value)
        # On the default socket its own identity is the one taken: suggest a new file beside it.
        with pytest.raises(startup.ClaimError, match=r"--identity \S*identity-2\.key"):
            startup.claim_identity(None, dirs / "run" / "peerd.sock")


def test_a_socket_in_use_is_refused_before_the_weights_load(
    dirs: Path, busy_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights loaded before the socket was checked")

    monkeypatch.setattr(blocks, "load_span", no_loading)
    config = DaemonConfig(new_swarm=True, blocks="0:30", socket=busy_socket, throughput="1")
    with pytest.raises(DaemonError, match="another peerd daemon is listening on"):
        run(config)
    assert not (dirs / "state").exists()  # nothing claimed either


def test_a_port_in_use_is_one_line_not_an_exception_group(dirs: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        config = DaemonConfig(
            new_swarm=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], socket=dirs / "a.sock"
        )
        with pytest.raises(DaemonError) as refused:
            run(config)
    finally:
        taken.close()
    assert "\n" not in str(refused.value) and str(refused.value)


@pytest.mark.slow  # a `peerd start` process: it imports torch, transformers and libp2p
def test_peerd_start_on_a_busy_socket_exits_2_with_one_line(dirs: Path, busy_socket: Path) -> None:
    started = subprocess.run(
        [sys.executable, "-m", "cli", "start", "--new-swarm", "--socket", str(busy_socket)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    assert started.returncode == 2, started.stderr
    assert started.stderr.splitlines() == [
        f"peerd start: another peerd daemon is listening on {busy_socket}; stop it or give this "
        "one another --socket"
    ]


def _wait_until_every_block_is_served(socket_path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    with Client(socket_path) as client:
        while True:
            served = {
                b
                for i in client.status().swarm
                if i.state == "online"
                for b in range(i.start, i.end)
            }
            if served == set(range(30)):
                return
            assert time.monotonic() < deadline, f"{socket_path}'s daemon sees blocks {served}"
            time.sleep(0.5)


class _OwnSocketOnly(DaemonProcess):
    """A daemon started as a user would start a second one: only --socket of its own."""

    def _own_files(self) -> list[str]:
        return ["--socket", str(self.socket)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_daemons_differing_only_in_socket_are_two_peers(swarm: LocalSwarm, dirs: Path) -> None:
    """Two more daemons join the session's swarm as a user would start them beside a first: one
    serving a block, one a pure client, nothing but --socket set apart."""
    common = ["--initial-peers", swarm.initial_peers[0], "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
              "--refresh-period", "2", "--torch-threads", "1", "--throughput", "20"]  # fmt: skip
    env = {"PEERD_STATE_DIR": str(dirs / "state"), "PEERD_RUNTIME_DIR": str(dirs / "run")}

    def daemon(name: str, blocks: str) -> _OwnSocketOnly:
        return _OwnSocketOnly(
            name=name, args=["--blocks", blocks, *common], identity=dirs / "unused.key", env=env,
            socket=dirs / f"{name}.sock", log_path=dirs / f"{name}.log",
        )  # fmt: skip

    first, second = daemon("a", "29:30"), daemon("b", "none")
    try:
        # Started side by side, as a user's two shells may: one start's wait is the other's.
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(d.start, timeout=300) for d in (first, second)]:
                started.result()
        assert first.peer_id != second.peer_id
        answers = []
        for each in (first, second):
            _wait_until_every_block_is_served(each.socket)
            with Client(each.socket) as client:
                answers.append(client.generate("The capital of France is", max_new_tokens=4))
        assert answers[0] == answers[1] and answers[0].strip()
        # A third on the first one's identity file is refused at once, naming another.
        taken = next((dirs / "state").glob("identity-a-*.key"))  # first's, from its socket
        config = DaemonConfig(new_swarm=True, identity=taken, socket=dirs / "c.sock")
        with pytest.raises(DaemonError, match="is in use by another peerd daemon") as refused:
            run(config)
        assert f"give this one --identity {startup.identity_for_socket(dirs / 'c.sock')}" in (
            str(refused.value)
        )
    finally:
        second.kill()
        first.kill()
