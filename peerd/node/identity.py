"""A daemon's persistent ed25519 identity: a 32-byte seed in a 0600 file, locked while a daemon
uses it."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

log = logging.getLogger(__name__)

SEED_BYTES = 32


class IdentityError(Exception):
    """The identity file exists but cannot be used."""


class IdentityInUse(IdentityError):
    """Another process on this machine holds the identity file's lock."""


def load_or_create_identity(path: Path) -> KeyPair:
    """Load the key pair whose seed is stored at `path`, creating the file on first use.

    The same file always yields the same peer id, so a restarted server keeps its place in
    other peers' routing tables and ban lists.
    """
    if path.exists():
        seed = path.read_bytes()
        if len(seed) != SEED_BYTES:
            raise IdentityError(
                f"identity file {path} holds {len(seed)} bytes, expected a {SEED_BYTES}-byte "
                "ed25519 seed: remove it to create a new identity (a new peer id)"
            )
        return create_new_key_pair(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        seed = secrets.token_bytes(SEED_BYTES)
        try:
            key_pair = create_new_key_pair(seed)
        except ValueError:  # a seed whose public key is not a valid point: draw again
            continue
        break
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed)
    os.replace(tmp, path)
    return key_pair


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)


@dataclass
class HeldIdentity:
    """An identity this process holds the lock of, until release() or its exit."""

    path: Path
    key_pair: KeyPair
    _fd: int | None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops its lock
            self._fd = None

    def __enter__(self) -> HeldIdentity:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def hold_identity(path: Path) -> HeldIdentity:
    """load_or_create_identity, with an exclusive lock on the file for as long as this process
    runs (the kernel drops it when the process dies, even by kill -9): two daemons on one
    identity would be one peer id to the swarm, and each would be routed the other's blocks.

    Raises IdentityInUse when another process holds it. Where the file system has no locks
    (some network mounts) the identity is used unlocked, with a warning.
    """
    load_or_create_identity(path)  # create it first: the lock is on the file itself
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise IdentityInUse(f"identity {path} is in use by another process") from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            raise
        log.warning(
            "cannot lock identity %s (%s): a second daemon on it would not be refused", path, e
        )
    # Read it again under the lock: what this daemon announces is what the file now holds.
    return HeldIdentity(path, load_or_create_identity(path), fd)
