"""Start `peerd start` daemons by forking a process that has already imported them.

A daemon spends ~10 s of a slow 2-core machine importing torch, transformers and py-libp2p
before it does anything (`python -X importtime -c "import peerd.daemon.main"`), and the
multi-process tests start some 70 daemons. The fork server imports all that once; each daemon
is then a fork of it that runs the CLI with its own arguments, output and log, as a separate
process with its own event loop, sockets and memory, exactly as `python -m cli start` would run
after its imports.

The forked daemon is handed to the caller as a ForkedProcess (the part of subprocess.Popen that
LocalSwarm and the tests use). It is a grandchild of the fork server, orphaned on purpose, so
that it is re-parented to the caller, which marks itself a child subreaper: the caller then
waits for it (its exit status, signals) as for any child.

Only for tests. A daemon may be given environment variables of peerd's own (PEERD_*: read when
the daemon runs, never at import) and a network namespace to enter (as `ip netns exec` does for
its sockets); one given any other environment variable, which an import may already have read
before the fork, is started the usual way (can_fork).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")  # where `ip netns add` keeps its namespaces
_SERVER_LOCK = threading.Lock()
_server: ForkServer | None = None


def daemon_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a daemon runs in, forked or not: ours, unbuffered, offline, plus `extra`."""
    return dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **(extra or {}))


def can_fork(env: dict[str, str]) -> bool:
    """Whether a daemon with these extra environment variables may be forked: only peerd's
    own, which the daemon reads when it runs."""
    return all(name.startswith("PEERD_") for name in env)


class ForkedProcess:
    """A forked daemon, re-parented to us: poll, wait, kill and send_signal as Popen's."""

    def __init__(self, pid: int, args: list[str], stdout: IO[str]) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One warm process (this module run as a script) that forks a daemon per request."""

    def __init__(self, cwd: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "peerd.devtools.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=daemon_env(),
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.reader = ours.makefile("r")

    def spawn(
        self, args: list[str], log: IO[str], env: dict[str, str], netns: str | None
    ) -> ForkedProcess:
        """Fork a daemon running `python -m cli ARGS` with its stdout to a pipe (returned as
        the process's stdout), its stderr to `log`, `env` added to its environment, in network
        namespace `netns` if one is named."""
        if not can_fork(env):
            raise ValueError(f"only PEERD_* variables can be given to a forked daemon: {env}")
        read_end, write_end = os.pipe()
        try:
            with self.lock:
                request = json.dumps({"args": args, "env": env, "netns": netns}).encode() + b"\n"
                socket.send_fds(self.sock, [request], [write_end, log.fileno()])
                reply = self.reader.readline()
        finally:
            os.close(write_end)
        if not reply:
            os.close(read_end)
            raise RuntimeError(f"the fork server exited ({self.process.poll()})")
        pid = int(json.loads(reply)["pid"])
        return ForkedProcess(pid, args, os.fdopen(read_end, "r"))

    def close(self) -> None:
        self.sock.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def spawn(
    args: list[str],
    log: IO[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    netns: str | None = None,
) -> ForkedProcess:
    """A daemon forked from this process's fork server (started on first use): ForkServer.spawn."""
    global _server
    with _SERVER_LOCK:
        if _server is None or _server.process.poll() is not None:
            _server = ForkServer(cwd)
        server = _server
    return server.spawn(args, log, env or {}, netns)


def shutdown() -> None:
    global _server
    with _SERVER_LOCK:
        if _server is not None:
            _server.close()
            _server = None


def _serve(fd: int) -> None:
    """The fork server's loop: a request per line with its two descriptors (stdout, log)."""
    # What a daemon spends its start-up importing: torch, transformers and every model family
    # (blocks), py-libp2p and the swarm's sessions. The daemon's own rooms above these are
    # imported by each fork (a fraction of a second).
    import blocks  # noqa: F401
    import peerd.session.leech  # noqa: F401

    sock = socket.socket(fileno=fd)
    buffer = b""
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 65536, 2)
        if not message:
            return  # the caller is gone
        buffer += message
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            pid = _fork_daemon(json.loads(line), fds, sock)
            for received in fds:
                os.close(received)
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _fork_daemon(request: dict[str, Any], fds: list[int], sock: socket.socket) -> int:
    """Fork twice so the daemon is orphaned (and re-parented to the caller); return its pid."""
    read_pid, write_pid = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_pid)
        daemon = os.fork()
        if daemon == 0:
            os.close(write_pid)
            sock.close()
            _run_daemon(request, fds)
        os.write(write_pid, str(daemon).encode())
        os._exit(0)
    os.close(write_pid)
    with os.fdopen(read_pid, "rb") as reader:
        pid = int(reader.read())
    os.waitpid(middle, 0)
    return pid


def _run_daemon(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked daemon: its own output, log, environment, network namespace and random
    state, then the CLI."""
    code = 1
    args: list[str] = request["args"]
    try:
        os.environ.update(request["env"])
        if netns := request["netns"]:
            _enter_netns(netns)
        stdout, log = fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(stdout, 1)
        os.dup2(log, 2)
        for fd in (devnull, stdout, log):
            os.close(fd)
        import torch

        torch.seed()  # `random` reseeds itself after a fork; torch's generator does not
        sys.argv = ["cli", *args]
        try:  # as `python -m cli ARGS` runs it
            runpy.run_module("cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing left to say
                stream.flush()
        os._exit(code)


def _enter_netns(name: str) -> None:
    """Move this process into network namespace `name`: its sockets from now on are there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _serve(int(argv[0]))


if __name__ == "__main__":
    main()
