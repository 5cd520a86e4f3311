"""What a daemon checks before it loads anything (its initial peers, its local API socket, its
TCP ports, its identity), and which failures are the user's to fix: those reach them as one
line, never as a traceback through the daemon's nurseries. A second daemon started beside a
first either gets its own identity (derived from its socket) or is refused at once, saying which
flag to give it.

Identities: the daemon on the default socket keeps `$PEERD_STATE_DIR/identity.key` (what every
earlier version used, so a volunteer keeps their peer id); a daemon on any other `--socket` gets
`identity-<socket name>-<hash of its path>.key` beside it, the same one at every restart on that
socket. An explicit `--identity FILE` wins. Whichever file it is, the daemon holds a lock on it
while it runs (peerd.node.identity.hold_identity), so two running daemons never share a peer id.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import torch
from multiaddr import Multiaddr

import blocks
from peerd.node import compute_thread
from peerd.node.identity import HeldIdentity, IdentityError, IdentityInUse, hold_identity
from peerd.node.p2p import BadMultiaddr, parse_peer_maddr
from peerd.paths import default_socket_path, state_dir


class ClaimError(Exception):
    """Something this daemon needs is taken or unusable; the message says what to do."""


# What a daemon can meet for reasons outside its code (a setting, the machine, the network).
EXPECTED_FAILURES = (ClaimError, OSError, BadMultiaddr, blocks.BlocksError)


def claim_machine(
    socket_path: Path, identity: Path | None, initial_peers: list[str], listen: list[str]
) -> HeldIdentity:
    """Check what needs no model, in the order a user would fix it, and hold the identity."""
    for text in initial_peers:
        parse_peer_maddr(text)  # BadMultiaddr says what a full multiaddr looks like
    check_socket_free(socket_path)
    check_ports_free(listen)
    return claim_identity(identity, socket_path)


def check_ports_free(listen: list[str]) -> None:
    """Refuse a TCP port of `listen` (multiaddrs) that another program holds: py-libp2p would
    go on without it, a daemon nobody can dial."""
    for text in listen:
        try:
            maddr = Multiaddr(text)
            names = [p.name for p in maddr.protocols()]
            family = socket.AF_INET6 if "ip6" in names else socket.AF_INET
            host = maddr.value_for_protocol("ip6" if "ip6" in names else "ip4")
            port = int(maddr.value_for_protocol("tcp"))
        except Exception:  # not an IP/TCP address (its checks are libp2p's)
            continue
        if port == 0:
            continue
        probe = socket.socket(family, socket.SOCK_STREAM)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener will
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ClaimError(
                f"cannot listen on {text}: {e.strerror} (another peerd daemon?); give this one "
                "another --port, or --port 0 for any free one"
            ) from None
        finally:
            probe.close()


def socket_in_use(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket at `path` (a file left by a
    daemon that died is not in use)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def check_socket_free(path: Path) -> None:
    if socket_in_use(path):
        raise ClaimError(
            f"another peerd daemon is listening on {path}; stop it or give this one another "
            "--socket"
        )


def identity_for_socket(socket_path: Path) -> Path:
    """The identity file a daemon on `socket_path` uses when no --identity is given."""
    here = Path(os.path.abspath(socket_path))
    if here == Path(os.path.abspath(default_socket_path())):
        return state_dir() / "identity.key"
    digest = hashlib.sha256(str(here).encode()).hexdigest()[:10]
    return state_dir() / f"identity-{here.stem}-{digest}.key"


def claim_identity(identity: Path | None, socket_path: Path) -> HeldIdentity:
    """Load (creating on first use) and lock the identity of a daemon on `socket_path`."""
    path = identity or identity_for_socket(socket_path)
    try:
        return hold_identity(path)
    except IdentityInUse:
        raise ClaimError(
            f"identity {path} is in use by another peerd daemon on this machine, and two "
            f"daemons must not share a peer id: give this one --identity "
            f"{_free_identity(path, socket_path)} (created on first use)"
        ) from None
    except (IdentityError, OSError) as e:
        raise ClaimError(str(e)) from None


def _free_identity(taken: Path, socket_path: Path) -> Path:
    """An identity file to suggest instead of `taken`: the one of this daemon's socket, else the
    first unused `<name>-N.key` beside it."""
    derived = identity_for_socket(socket_path)
    if derived != taken:
        return derived
    number = 2
    while (candidate := taken.with_name(f"{taken.stem}-{number}{taken.suffix}")).exists():
        number += 1
    return candidate


def set_up_threads(torch_threads: int | None, prefill_threads: int | None) -> None:
    """Torch passes run on the compute thread with `torch_threads` threads for decode steps
    (None: torch's count, every core) and `prefill_threads` for prompts; the event loop's thread
    keeps one (peerd.node.compute_thread says why)."""
    cores = torch.get_num_threads()
    blocks.threads.configure(torch_threads or cores, prefill_threads)
    compute_thread.quiet_event_loop_thread()


async def load_serving_span(
    checkpoint: Path,
    span: tuple[int, int],
    serving: blocks.Serving,
    adapters: list[blocks.AdapterInfo],
    compile_passes: bool,
    budget: int | None = None,
    cache_tokens: int = 0,
) -> blocks.Span:
    """The blocks `span` of `checkpoint` as a server serves them, loaded on the compute thread;
    with `compile_passes` (`--compile`), their decode steps and prompts compiled there too,
    where they can be (blocks.compiled), before the server measures its throughput, and packed
    copies of their weights kept only within what the memory `budget` (None: none) leaves
    beside them and a cache of `cache_tokens`."""
    loaded = await compute_thread.run(
        blocks.load_span, checkpoint, *span, serving.dtype, serving.device, adapters, serving.quant
    )
    if compile_passes:
        room = None if budget is None else budget - held_bytes(loaded, cache_tokens)
        await compute_thread.run(loaded.compile_passes, room)
    return loaded


def held_bytes(span: blocks.Span, cache_tokens: int) -> int:
    """What `span` counts against a memory budget: its weights, and a KV cache of
    `cache_tokens` in each of its blocks (as `--blocks auto` counts them)."""
    per_block = blocks.cache_bytes_per_block(span.config, span.dtype, cache_tokens)
    return span.weight_bytes + span.num_blocks * per_block
