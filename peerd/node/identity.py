"""A daemon's persistent ed25519 identity: a 32-byte seed in a 0600 file."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

SEED_BYTES = 32


class IdentityError(Exception):
    """The identity file exists but cannot be used."""


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
