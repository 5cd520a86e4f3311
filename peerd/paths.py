"""Where peerd keeps its per-user files: identity (state), sockets (runtime)."""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    """Long-lived per-user state (identities); `$PEERD_STATE_DIR` overrides."""
    if env := os.environ.get("PEERD_STATE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "peerd"


def runtime_dir() -> Path:
    """Per-user directory for sockets, created 0700; `$PEERD_RUNTIME_DIR` overrides."""
    if env := os.environ.get("PEERD_RUNTIME_DIR"):
        path = Path(env)
    elif xdg := os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(xdg) / "peerd"
    else:
        path = Path(f"/tmp/peerd-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def default_socket_path() -> Path:
    return runtime_dir() / "peerd.sock"
