"""The DHT provider keys of a swarm: the model key every server of a model provides, the
swarm-wide models key, and per-block keys (peerd.session.swarm announces and looks them up)."""

from __future__ import annotations

import hashlib

# sha2-256 multihash prefix: remote DHT nodes accept multihash keys of any length we need.
_MULTIHASH_SHA256 = b"\x12\x20"


def _dht_key(text: str) -> str:
    return (_MULTIHASH_SHA256 + hashlib.sha256(text.encode()).digest()).hex()


def _prefix(swarm_name: str) -> str:
    # The public swarm keeps the keys it always had; a private swarm's keys differ entirely, so
    # daemons of other swarms sharing the DHT (on one LAN, through mDNS) never find its servers.
    return f"peerd/{swarm_name}/" if swarm_name else "peerd/"


def model_key(model: str, swarm_name: str = "") -> str:
    """The DHT provider key every server of `model` provides (hex of a sha2-256 multihash)."""
    return _dht_key(f"{_prefix(swarm_name)}{model}")


def models_key(swarm_name: str = "") -> str:
    """The swarm-wide DHT provider key every server provides whatever its model: a daemon finds
    the models of a swarm of several by asking its providers for their records."""
    return _dht_key(f"{_prefix(swarm_name)}models")


def block_key(model: str, block: int, swarm_name: str = "") -> str:
    """The DHT provider key of one block: looked up only for blocks the model key did not cover
    (a DHT node keeps at most 20 providers per key, so big swarms need per-block keys)."""
    return _dht_key(f"{_prefix(swarm_name)}{model}/block/{block}")
