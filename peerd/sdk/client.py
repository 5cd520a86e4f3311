"""The client library: talk to the local peerd daemon over its Unix socket.

    from peerd.sdk.client import Client
    with Client() as client:
        for piece in client.generate("Once upon a time", max_new_tokens=32, stream=True):
            print(piece, end="", flush=True)

`AsyncClient` offers the same calls as coroutines on anyio, so it works under trio and asyncio
alike (web frameworks included): `async with AsyncClient() as client: ...`. Client is generated
from it (sync_client.py), so both have every method, with the same parameters and timeout.
Errors the daemon reports raise `PeerdError`.

Both take routing controls for every generation and session they start (see `route_options`):
    Client(allowed_servers=["12D3KooW..."], blocked_servers=[...], max_retries=2,
           connect_timeout=5, request_timeout=30, show_route=True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peerd.sdk.async_client import AsyncClient
from peerd.sdk.errors import BadRouteOptions, DaemonNotRunning, PeerdError
from peerd.sdk.options import (
    DEFAULT_TIMEOUT_S,
    GenerateOptions,
    Generation,
    print_route,
    route_options,
    socket_path,
)
from peerd.sdk.sync_client import SyncClient
from peerd.sdk.transport import READ_CHUNK

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "READ_CHUNK",
    "AsyncClient",
    "BadRouteOptions",
    "Client",
    "DaemonNotRunning",
    "GenerateOptions",
    "Generation",
    "PeerdError",
    "print_route",
    "route_options",
    "socket_path",
]


class Client(SyncClient):
    """A blocking connection to the local daemon, connected on construction (DaemonNotRunning
    when none answers); use it as a context manager, which closes it."""

    def __init__(
        self,
        path: str | Path | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        show_route: bool = False,
        **routing: Any,
    ) -> None:
        super().__init__(path, timeout, show_route=show_route, **routing)
        self.connect()
