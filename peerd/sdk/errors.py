"""What the client library raises: the daemon's errors, no daemon at all, bad routing controls."""

from __future__ import annotations

from pathlib import Path

import wire


class PeerdError(Exception):
    """The daemon refused or failed a request; `code` is machine-readable (wire.ErrorCode)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class DaemonNotRunning(PeerdError):
    """Nothing answers on the daemon's socket; the message says how to start a daemon."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            wire.ErrorCode.NO_DAEMON,
            f"no peerd daemon answers on {path} ({reason}); start one with "
            "`peerd start --new-swarm` (or `--initial-peers MULTIADDR` to join a swarm), or "
            "point to its socket with --socket / PEERD_SOCKET",
        )


class BadRouteOptions(PeerdError, ValueError):
    """Routing controls the daemon would refuse: a malformed peer id, a negative timeout..."""

    def __init__(self, message: str) -> None:
        super().__init__(wire.ErrorCode.BAD_REQUEST, message)
