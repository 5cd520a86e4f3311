"""The daemon's local API: wire frames over a Unix socket (mode 0600) for local programs.

One connection is one client. It says Hello, then sends requests one at a time: Generate
(answered by a GeneratedToken per token, then GenerateDone; Cancel stops it), OpenInference /
InferenceStep / CloseInference (hidden states through every block, for the transformers-compatible
model), TrainingForward / TrainingBackward (cache-less passes for fine-tuning,
peerd.session.training), and StatusRequest. Sessions a connection opens die with it. A malformed
request gets an Error reply and, when the framing itself is broken, the connection is closed; a
request that fails inside the daemon gets Error(internal); the daemon and its other clients go
on. The spec is docs/api.md.

This module owns the socket: binding it, the accept loop (trio.serve_listeners, which sleeps and
retries when the process runs out of file descriptors) and the boundary around each connection.
A connection's requests are answered in peerd.daemon.api_connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

import wire
from peerd import __version__
from peerd.daemon.api_connection import ApiConnection, sole_cause
from peerd.daemon.api_session import ApiError
from peerd.daemon.contributions import contributor_share, standing_seen
from peerd.daemon.startup import socket_in_use
from peerd.paths import UnsafeDirectory, check_socket_dir
from peerd.session.generation import Generator
from routing.records import record_to_info

__all__ = ["ApiError", "LocalApi", "build_status"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
# Connections the kernel queues for us while we are busy accepting others.
LISTEN_BACKLOG = 64


class LocalApi:
    """Serves one daemon's Unix socket."""

    def __init__(
        self,
        *,
        socket_path: Path,
        get_generator: Callable[[], Awaitable[Generator]],
        status: Callable[[], wire.StatusResponse],
        welcome: Callable[[], wire.Welcome],
        models: Callable[[str], Awaitable[Generator]] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.generator = get_generator  # the client side, loaded on first use
        self.models = models  # the generator of a model a request names (None: one model only)
        self.status = status
        self.welcome = welcome
        self.connections = 0
        self.generations = 0  # Generate requests answered (peerd_generations_total)

    async def generator_for(self, model: str | None) -> Generator:
        """The generator of the model a request names (None: the daemon's own)."""
        if model is None:
            return await self.generator()
        if self.models is not None:
            return await self.models(model)
        generator = await self.generator()
        if model != generator.swarm.model:
            raise ApiError(
                wire.ErrorCode.UNSUPPORTED, f"this daemon runs {generator.swarm.model}, not {model}"
            )
        return generator

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on the socket until cancelled; task_status gets its path."""
        path = self.socket_path
        listener = await _bind(path)
        try:
            task_status.started(path)
            await self.serve_listener(listener)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()
            path.unlink(missing_ok=True)

    async def serve_listener(self, listener: trio.abc.Listener[trio.abc.Stream]) -> None:
        """Accept connections forever, each in a task of its own. serve_listeners rides out
        EMFILE/ENFILE (it logs, sleeps and accepts again) instead of ending the daemon."""
        await trio.serve_listeners(self._serve_connection, [listener])

    async def _serve_connection(self, stream: trio.abc.Stream) -> None:
        """One client from accept to hang-up; nothing that goes wrong in it leaves this task."""
        if self.connections >= MAX_CONNECTIONS:
            await stream.aclose()
            return
        self.connections += 1
        connection = ApiConnection(self, stream)
        try:
            await connection.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client hung up mid-request
        except Exception as e:
            # Requests have their own boundary (api_connection); this is a bug in reading.
            log.exception("local API: a connection failed; closing it")
            with contextlib.suppress(Exception):  # best effort: the client may hear why
                text = f"the daemon failed reading this connection: {sole_cause(e)!r}; closing it"
                await connection.error(wire.ErrorCode.INTERNAL, text)
        finally:
            self.connections -= 1
            with trio.CancelScope(shield=True):
                await _close_quietly(connection)


async def _bind(path: Path) -> trio.SocketListener:
    """A listening socket at `path` that only its owner may talk to, replacing a stale one, in
    a directory nobody else can write in (peerd.paths; UnsafeDirectory says how to fix one)."""
    check_socket_dir(path.parent)
    if os.path.lexists(path):
        if socket_in_use(path):
            raise OSError(
                f"another peerd daemon is listening on {path}; stop it or give this one "
                "another --socket"
            )
        owner = os.lstat(path).st_uid
        if owner != os.getuid():
            raise UnsafeDirectory(
                f"{path} belongs to user id {owner}, not to you: remove it (as that user or "
                "root) or give this daemon another --socket"
            )
        path.unlink()
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket file is created 0600: only its owner may talk
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(LISTEN_BACKLOG)
    return trio.SocketListener(sock)


async def _close_quietly(connection: ApiConnection) -> None:
    """Close a connection's sessions and stream; a failure here must not reach the accept loop."""
    try:
        await connection.close()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    except Exception:
        log.exception("local API: closing a connection's sessions failed")
        await trio.aclose_forcefully(connection.stream)


def build_status(
    *,
    peer_id: str,
    started_at: float,
    server: Any,
    swarm: Any,
    models: tuple[wire.SwarmModel, ...] = (),
) -> wire.StatusResponse:
    records = list(swarm.records.values()) if swarm is not None else []
    return wire.StatusResponse(
        peer_id=peer_id,
        version=__version__,
        uptime_s=max(0.0, time.time() - started_at),
        serving=record_to_info(server.record()) if server is not None else None,
        swarm=tuple(record_to_info(r) for r in records),
        rtts=tuple(float(swarm.rtts.get(r.peer_id, -1.0)) for r in records),
        steps_served=server.counters.steps if server is not None else 0,
        tokens_served=server.counters.tokens_processed if server is not None else 0,
        reachability=swarm.node.reachability.value if swarm is not None else "unknown",
        links=tuple(swarm.link(r.peer_id) for r in records) if swarm is not None else (),
        num_blocks=swarm.num_blocks if swarm is not None else 0,
        addrs=tuple(swarm.node.maddrs()) if swarm is not None else (),
        models=models,
        standing=standing_seen(swarm),
        contributor_share=contributor_share(server),
    )
