"""Who may use the gateway: the checks every request and WebSocket passes before any route runs.

A browser lets any web page the user visits send requests to 127.0.0.1, so "it listens on
localhost" protects nothing by itself. Three attacks, three checks:

- DNS rebinding: a page at evil.example re-points its name to 127.0.0.1 and then reads and posts
  as same-origin. Its requests carry `Host: evil.example`, so the `Host` must be a loopback name
  or address, one of `--allowed-hosts`, or (when the gateway listens beyond loopback) an IP
  address: rebinding needs a name the attacker controls.
- Cross-site requests: a form post or a `no-cors` fetch from another site runs a generation
  without ever reading the answer. Every POST and WebSocket that carries an `Origin` must come
  from this gateway's own origin or one of `--allowed-origins`; `Origin: null` never passes; with
  no `Origin`, a browser's `Sec-Fetch-Site: cross-site|same-site` is refused too. Programs send
  neither and pass. (JSON bodies must also say `application/json`: bodies.py.)
- Anyone on the network, once the gateway listens beyond loopback: an API key, sent as
  `Authorization: Bearer KEY` (what OpenAI's clients send) or, by a browser's WebSocket, which
  cannot set headers, as the subprotocol `peerd.key.KEY` beside `peerd`. The pages themselves
  (/, /swarm, /static) need no key; the page asks the user for it.

Refusals are 403 (host, origin) and 401 (key), as JSON in the shape of the API called; a refused
WebSocket handshake gets a bare 403, and the reason goes to the log.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from peerd.gateway.link import GatewayError

log = logging.getLogger(__name__)

KEY_PROTOCOL_PREFIX = "peerd.key."
"""A WebSocket subprotocol that carries the API key (browsers cannot set Authorization there)."""

PAGE_PROTOCOL = "peerd"
"""The subprotocol the gateway selects when a client offers it (a browser that offers any
subprotocol fails the handshake unless the server selects one)."""

API_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~-]{16,256}")
"""Characters a key may use, so that it fits in a header and in a WebSocket subprotocol (an HTTP
token); at least 16 of them, so that it cannot be guessed over HTTP."""

PUBLIC_PATHS = ("/", "/swarm", "/favicon.ico")
PUBLIC_PREFIXES = ("/static/",)
"""Pages that hold no data and run nothing; the page asks for the key before it calls an API."""

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods a cross-origin page cannot use to change anything here (nothing here acts on GET),
and whose answers the browser hides from another origin (the gateway sends no CORS headers
unless --allowed-origins names it)."""

Render = Callable[[str, GatewayError], Response]


def check_api_key(key: str) -> str:
    """`key`, or ValueError saying what a key must look like."""
    if not API_KEY_PATTERN.fullmatch(key):
        raise ValueError(
            "an API key must be 16 to 256 characters among A-Z a-z 0-9 . _ ~ -; make one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(24))'`"
        )
    return key


def is_loopback_host(host: str) -> bool:
    """True for a loopback name (localhost, *.localhost: browsers resolve them to loopback
    themselves) or address, with or without brackets."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def host_name(host_header: str) -> str:
    """The name or address of a Host header, without port or brackets, lowercased."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


@dataclass(frozen=True)
class Exposure:
    """Who the gateway answers. The default (loopback only, no key) is right for a gateway on
    127.0.0.1; `for_bind` says what listening elsewhere needs."""

    allowed_hosts: frozenset[str] = frozenset()
    """Extra Host names or addresses ("*": any), lowercased, without port."""
    allowed_origins: frozenset[str] = frozenset()
    """Extra origins ("https://app.example", "*": any) whose pages may POST and open sockets."""
    api_key: str | None = None
    public: bool = False
    """The gateway listens beyond loopback: any IP address is a fine Host."""

    @classmethod
    def for_bind(
        cls,
        bind_host: str,
        *,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        api_key: str | None = None,
    ) -> Exposure:
        """The exposure of a gateway listening on `bind_host`; ValueError when that is beyond
        loopback without an API key, or when an option is malformed."""
        public = not is_loopback_host(bind_host)
        if api_key is not None:
            check_api_key(api_key)
        elif public:
            raise ValueError(
                f"listening on {bind_host} lets anyone who reaches this machine use the swarm "
                "through the gateway: set an API key (PEERD_GATEWAY_API_KEY=KEY, or --api-key "
                "KEY) that clients send as `Authorization: Bearer KEY`, or listen on 127.0.0.1"
            )
        hosts = {host_name(h) for h in allowed_hosts if h.strip()}
        if public and not _is_ip(bind_host.strip("[]")) and bind_host.strip():
            hosts.add(host_name(bind_host))
        origins = set()
        for origin in allowed_origins:
            origin = origin.strip().rstrip("/").lower()
            if origin != "*" and not re.fullmatch(r"https?://[^/?#\s]+", origin):
                raise ValueError(
                    f"--allowed-origins {origin!r}: give origins as scheme://host[:port], "
                    "e.g. https://chat.example.org, or *"
                )
            origins.add(origin)
        return cls(frozenset(hosts), frozenset(origins), api_key, public)

    def host_allowed(self, host_header: str | None) -> bool:
        if host_header is None:
            return True  # HTTP/1.0 programs; every browser sends Host
        host = host_name(host_header)
        if "*" in self.allowed_hosts or host in self.allowed_hosts or is_loopback_host(host):
            return True
        return self.public and _is_ip(host)

    def origin_allowed(self, origin: str | None, fetch_site: str | None, host: str | None) -> bool:
        if origin is None:
            # Browsers that send Sec-Fetch-Site and no Origin: refuse what they say is cross-site.
            return (fetch_site or "").lower() not in ("cross-site", "same-site")
        origin = origin.strip().rstrip("/").lower()
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        if origin == "null" or host is None:
            return False  # sandboxed frames, data: URLs, file: pages
        scheme, separator, netloc = origin.partition("://")
        return bool(separator) and scheme in ("http", "https") and netloc == host.strip().lower()

    def key_given(self, headers: Headers, subprotocols: Iterable[str]) -> bool:
        if self.api_key is None:
            return True
        expected = self.api_key.encode()
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected):
            return True
        for protocol in subprotocols:
            if protocol.startswith(KEY_PROTOCOL_PREFIX):
                given = protocol[len(KEY_PROTOCOL_PREFIX) :].encode()
                if hmac.compare_digest(given, expected):
                    return True
        return False

    def refusal(self, scope: Scope) -> GatewayError | None:
        """Why the request or socket of `scope` may not go on, or None."""
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.host_allowed(host):
            return GatewayError(
                403,
                "host_not_allowed",
                f"this gateway does not answer for the host {host_name(host or '')!r} (a web "
                "page that re-points its name at this machine would use it): open it by "
                "127.0.0.1 or localhost, or start it with --allowed-hosts NAME",
            )
        method = scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET"
        if method not in SAFE_METHODS and not self.origin_allowed(
            headers.get("origin"), headers.get("sec-fetch-site"), host
        ):
            return GatewayError(
                403,
                "origin_not_allowed",
                f"a web page from {headers.get('origin') or 'another site'} may not use this "
                "gateway: only its own pages may, and programs (which send no Origin); to let "
                "another site's page in, start the gateway with --allowed-origins ORIGIN",
            )
        path = scope.get("path", "")
        public = path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES) or method == "OPTIONS"
        if not public and not self.key_given(headers, scope.get("subprotocols", ())):
            return GatewayError(
                401,
                "invalid_api_key",
                "this gateway needs its API key: send `Authorization: Bearer KEY` (OpenAI "
                "clients: api_key=KEY)",
            )
        return None


class Guard:
    """ASGI middleware: requests and sockets that `exposure` refuses get their refusal, rendered
    by `render` (HTTP) or as a refused handshake (WebSocket); the rest reach `app`."""

    def __init__(self, app: ASGIApp, exposure: Exposure, render: Render) -> None:
        self.app = app
        self.exposure = exposure
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal = self.exposure.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # A bare 403 to the handshake: uvicorn logs an error after a denial with a body
            # (websocket.http.response), so the reason goes to our log instead.
            log.info("refused a WebSocket to %s: %s", scope.get("path"), refusal)
            await send({"type": "websocket.close", "code": 1008, "reason": refusal.code})
            return
        response = self.render(scope.get("path", ""), refusal)
        if refusal.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="peerd gateway"'
        await response(scope, receive, send)
