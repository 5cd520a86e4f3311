"""`peerd.client`, the name programs import; the client library lives in peerd.sdk.client."""

from peerd.sdk.client import (
    DEFAULT_TIMEOUT_S,
    AsyncClient,
    BadRouteOptions,
    Client,
    DaemonNotRunning,
    GenerateOptions,
    Generation,
    PeerdError,
    route_options,
    socket_path,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "BadRouteOptions",
    "Client",
    "DaemonNotRunning",
    "GenerateOptions",
    "Generation",
    "PeerdError",
    "route_options",
    "socket_path",
]
