"""The directory of the local API socket is ours alone (security review finding 10): another
local user who creates /tmp/peerd-$UID first, or a loose mode, or a symbolic link, is refused
with a message saying how to fix it, by the daemon and by clients alike. Run as root, so other
owners are made with os.chown."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from peerd import paths
from peerd.daemon import local_api
from peerd.paths import UnsafeDirectory
from peerd.sdk.client import Client

STRANGER = 54321  # a user id that is not ours
# Giving a file to another user takes root (CI and the dev machines run the tests as root).
as_root = pytest.mark.skipif(os.getuid() != 0, reason="os.chown to another user needs root")


@pytest.fixture
def fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fallback runtime directory (no XDG_RUNTIME_DIR), under tmp_path instead of /tmp so
    that the daemons of other tests keep theirs."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("PEERD_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("PEERD_SOCKET", raising=False)
    parent = tmp_path / "tmp"
    parent.mkdir()
    os.chmod(parent, 0o1777)  # like /tmp: anyone may create names in it
    monkeypatch.setattr(paths, "FALLBACK_RUNTIME_PARENT", parent)
    yield parent / f"peerd-{os.getuid()}"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_missing_fallback_directory_is_created_0700(fallback: Path) -> None:
    old = os.umask(0)  # the mode comes from mkdir itself, whatever the umask
    try:
        assert paths.default_socket_path() == fallback / "peerd.sock"
    finally:
        os.umask(old)
    assert fallback.is_dir() and _mode(fallback) == 0o700
    assert os.lstat(fallback).st_uid == os.getuid()
    assert paths.runtime_dir() == fallback  # ours and private: used again


@as_root
def test_a_fallback_directory_of_another_user_is_refused(fallback: Path) -> None:
    fallback.mkdir(mode=0o700)
    os.chown(fallback, STRANGER, STRANGER)
    with pytest.raises(UnsafeDirectory, match=f"belongs to user id {STRANGER}") as refused:
        paths.runtime_dir()
    assert "XDG_RUNTIME_DIR" in str(refused.value)
    # A client asking for the default socket is refused the same way, before connecting.
    with pytest.raises(UnsafeDirectory, match="take over peerd's socket"):
        Client()


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o770], ids=oct)
def test_a_fallback_directory_others_may_enter_is_refused(fallback: Path, mode: int) -> None:
    fallback.mkdir()
    os.chmod(fallback, mode)
    with pytest.raises(UnsafeDirectory, match=f"mode {mode:04o}.*chmod 700 {fallback}"):
        paths.runtime_dir()
    assert _mode(fallback) == mode  # refused, not silently changed


def test_a_symbolic_link_is_refused(fallback: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    fallback.symlink_to(target)
    with pytest.raises(UnsafeDirectory, match="symbolic link"):
        paths.runtime_dir()


def test_a_file_in_its_place_is_refused(fallback: Path) -> None:
    fallback.write_text("")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        paths.runtime_dir()


def test_peerd_runtime_dir_is_held_to_the_same_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loose = tmp_path / "run"
    loose.mkdir()
    os.chmod(loose, 0o777)
    monkeypatch.setenv("PEERD_RUNTIME_DIR", str(loose))
    with pytest.raises(UnsafeDirectory, match="mode 0777"):
        paths.default_socket_path()
    os.chmod(loose, 0o700)
    assert paths.default_socket_path() == loose / "peerd.sock"


@as_root
async def test_the_daemon_binds_only_in_a_directory_others_cannot_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeDirectory, match="writable by other users"):
        await local_api._bind(shared / "peerd.sock")
    assert not (shared / "peerd.sock").exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, STRANGER, STRANGER)
    with pytest.raises(UnsafeDirectory, match=f"belongs to user id {STRANGER}"):
        await local_api._bind(theirs / "peerd.sock")


@as_root
async def test_a_stale_socket_of_another_user_is_not_replaced(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: shared, but nobody may replace another's files
    stale = sticky / "peerd.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))
    dead.close()  # a socket file nobody listens on
    os.chown(stale, STRANGER, STRANGER, follow_symlinks=False)
    with pytest.raises(UnsafeDirectory, match=f"belongs to user id {STRANGER}"):
        await local_api._bind(stale)
    os.chown(stale, os.getuid(), os.getgid(), follow_symlinks=False)
    listener = await local_api._bind(stale)  # our own stale socket: replaced
    try:
        assert _mode(stale) == 0o600 and stat.S_ISSOCK(os.lstat(stale).st_mode)
    finally:
        await listener.aclose()


def test_peerd_commands_say_what_is_wrong_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from cli import app

    loose = tmp_path / "run"
    loose.mkdir()
    os.chmod(loose, 0o777)
    monkeypatch.delenv("PEERD_SOCKET", raising=False)
    monkeypatch.setenv("PEERD_RUNTIME_DIR", str(loose))
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 2, result.output
    assert f"chmod 700 {loose}" in result.output and "Traceback" not in result.output
