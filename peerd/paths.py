"""Where peerd keeps its per-user files: identity (state), sockets (runtime).

The runtime directory holds the local API socket, and whoever can write in it can swap the
socket for their own: read every prompt, answer as the daemon. Without $XDG_RUNTIME_DIR it is
/tmp/peerd-$UID, a name any local user can create first. So it is created 0700 in one step
(`mkdir` with the mode), and one that exists is used only if it is a real directory (not a
symbolic link) owned by this user with no access for group or others; otherwise
`UnsafeDirectory` says what is wrong and how to fix it. An explicit `--socket` elsewhere needs a
directory nobody else can write in (`check_socket_dir`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# Where the runtime directory goes when $XDG_RUNTIME_DIR is unset (one per user id).
FALLBACK_RUNTIME_PARENT = Path("/tmp")

_FIX = "or set XDG_RUNTIME_DIR (or PEERD_RUNTIME_DIR) to a directory of your own with mode 0700"
_FIX_SOCKET = "or give --socket a path in a directory of your own"


class UnsafeDirectory(PermissionError):
    """A directory for peerd's socket that others could control; the message says how to fix
    it. A PermissionError, so that what reports OSErrors reports it as one line."""


def state_dir() -> Path:
    """Long-lived per-user state (identities); `$PEERD_STATE_DIR` overrides."""
    if env := os.environ.get("PEERD_STATE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "peerd"


def runtime_dir() -> Path:
    """Per-user directory for sockets, created 0700 or checked to be private (UnsafeDirectory
    if not); `$PEERD_RUNTIME_DIR` overrides, else `$XDG_RUNTIME_DIR/peerd`, else
    /tmp/peerd-$UID."""
    if env := os.environ.get("PEERD_RUNTIME_DIR"):
        path = Path(env)
    elif xdg := os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(xdg) / "peerd"
    else:
        path = FALLBACK_RUNTIME_PARENT / f"peerd-{os.getuid()}"
    return private_dir(path)


def default_socket_path() -> Path:
    return runtime_dir() / "peerd.sock"


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter: created 0700 if missing (its parents as
    usual), else checked to be a real directory of ours with no group or other access."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # atomic: nobody else can have it in between
    except FileExistsError:
        pass
    else:
        os.chmod(path, 0o700)  # a umask that took our own bits away; ours, so nobody raced us
    info = os.lstat(path)
    _check_kind_and_owner(path, info, _FIX)
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise UnsafeDirectory(
            f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: other users may replace "
            f"peerd's socket in it. Run `chmod 700 {path}` (and remove anything in it you did "
            f"not put there), {_FIX}"
        )
    return path


def check_socket_dir(directory: Path) -> None:
    """Create the directory of an explicitly given socket (0700) if missing; refuse one that
    another user owns, or that others may write in and that is not sticky (like /tmp, where
    nobody may remove or rename another user's socket)."""
    if not os.path.lexists(directory):
        private_dir(directory)
        return
    info = os.stat(directory)  # a symbolic link to a directory (/var/run) is that directory
    _check_kind_and_owner(directory, info, _FIX_SOCKET, root_ok=True)
    shared = stat.S_IMODE(info.st_mode) & 0o022
    if shared and not info.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            f"{directory} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}), "
            f"so they could replace the socket in it. Run `chmod go-w {directory}`, {_FIX_SOCKET}"
        )


def _check_kind_and_owner(
    path: Path, info: os.stat_result, fix: str, *, root_ok: bool = False
) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeDirectory(
            f"{path} is a symbolic link (to {os.readlink(path)}); peerd keeps its socket only in "
            f"a real directory of its own. Remove the link (`rm {path}`), {fix}"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory; remove it, {fix}")
    uid = os.getuid()
    if info.st_uid != uid and not (root_ok and info.st_uid == 0):
        raise UnsafeDirectory(
            f"{path} belongs to user id {info.st_uid}, not to you (user id {uid}): another "
            "user may have created it to take over peerd's socket. Have it removed (by that "
            f"user or root), {fix}"
        )
