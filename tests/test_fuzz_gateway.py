"""Fuzzing the gateway through the real app: uvicorn on a real socket, in front of a real LocalApi
whose generations the daemon refuses with `no_route` (what a daemon without servers answers), so
that every request runs the guard, body reading, validation and tokenizing before it meets the
daemon.

Random and mutated HTTP requests (methods, paths, query strings, headers such as Host, Origin,
Content-Type, Content-Length and Transfer-Encoding, JSON and form bodies with wrong types, odd
numbers, lone surrogates, deep nesting, then byte flips and cuts), and WebSocket handshakes
followed by mutated frames. A crash is an ERROR logged by the app or uvicorn (an unhandled
exception), a 500, or a connection that stays silent past DEADLINE_S. Reproducible (seeded); the
counts and the slowest case are printed with -s.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import uvicorn

import wire
from blocks.default_model import NAME as DEFAULT_MODEL
from peerd.daemon.api_session import ApiError
from peerd.daemon.local_api import LocalApi
from peerd.gateway import create_app
from peerd.gateway.app import uvicorn_config
from tests.test_gateway import wait_until

LOGGERS = ("uvicorn.error", "uvicorn.asgi", "peerd.gateway", "asyncio")
"""Where an unhandled exception in the gateway would be logged."""

HTTP_CASES = 2500
WS_CASES = 400
DEADLINE_S = 30.0
"""A case that gets no answer (nor a hang-up) within this is a hung connection: generous, for a
loaded 2-core CI machine; answers take milliseconds."""


class NoRouteDaemon:
    """A real LocalApi on a Unix socket, in a trio thread; its generations and sessions are
    refused with no_route."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ready = threading.Event()
        self.token: trio.lowlevel.TrioToken | None = None
        self.scope: trio.CancelScope | None = None
        self.thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _no_route(self) -> Any:
        raise ApiError(wire.ErrorCode.NO_ROUTE, f"no peer serves blocks 0-29 of {DEFAULT_MODEL}")

    async def _main(self) -> None:
        api = LocalApi(
            socket_path=self.path,
            get_generator=self._no_route,
            status=lambda: wire.StatusResponse(peer_id="12D3KooWFuzz", version="0", uptime_s=1),
            welcome=lambda: wire.Welcome(
                version="0",
                peer_id="12D3KooWFuzz",
                model=DEFAULT_MODEL,
                num_blocks=30,
                hidden_size=576,
            ),
        )
        self.token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(api.serve)
                self.ready.set()

    def __enter__(self) -> NoRouteDaemon:
        self.thread.start()
        assert self.ready.wait(30), "the daemon's socket did not open"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.scope is not None and self.token is not None
        trio.from_thread.run_sync(self.scope.cancel, trio_token=self.token)
        self.thread.join(10)


class ErrorLog(logging.Handler):
    """Errors the gateway logs. An asyncio error counts only from the gateway's own event loop
    (`loop_thread`): another loop of this test process (one shutting down its executor after an
    earlier test, say) logs to the same "asyncio" logger, and that is not the gateway failing."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.loop_thread: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "asyncio" and record.thread != self.loop_thread:
            return
        self.records.append(record)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, ErrorLog]]:
    path = tmp_path_factory.mktemp("fuzz") / "peerd.sock"
    errors = ErrorLog()
    with NoRouteDaemon(path):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        server = uvicorn.Server(uvicorn_config(create_app(path), "127.0.0.1", port, "warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        errors.loop_thread = thread.ident
        try:
            wait_until(lambda: server.started, 60, "uvicorn started")
            for name in LOGGERS:
                logging.getLogger(name).addHandler(errors)
            yield port, errors
        finally:
            for name in LOGGERS:
                logging.getLogger(name).removeHandler(errors)
            server.should_exit = True
            thread.join(15)


# --- what to send -----------------------------------------------------------------------------

JUNK: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**64,
    -(2**63),
    1e308,
    -1e-308,
    0.5,
    float("nan"),
    float("inf"),
    "",
    " ",
    "1",
    "true",
    "\ud800",
    "\x00",
    "é" * 50,
    "x" * 5000,
    [],
    {},
    [1, "a"],
    {"role": "user"},
    {"type": "text", "text": None},
    "<|im_start|>system\n",
    "\u202e\ufeff",
]

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "default", "prompt": "1, 2, 3,", "max_tokens": 4, "stop": [" 8"]}
V1 = {"inputs": "The capital of France is", "max_new_tokens": 4, "do_sample": 1, "top_p": 0.9}
V2_OPEN = {"type": "open_inference_session", "max_length": 64}
V2_GENERATE = {"type": "generate", "inputs": "hi", "max_new_tokens": 2, "stop_sequence": "\n"}

POSTS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/api/v1/generate", V1)]
GETS = [
    "/",
    "/api/status",
    "/api/v1/swarm",
    "/v1/models",
    "/v1/models/default",
    "/v1/models/%00",
    "/swarm",
    "/static/chat.js",
    "/static/../../etc/passwd",
    "/static/%2e%2e/app.py",
    "/nope",
    "/api/v2/generate",
    "//v1/models",
    "/v1/models/" + "a" * 3000,
]
HOSTS = ["127.0.0.1", "localhost:1", "[::1]", "evil.example", "", "127.0.0.1:99999", "[::1", ":"]
ORIGINS = ["null", "http://evil.example", "http://127.0.0.1", "", "://", "http://[::1"]
TYPES = [
    "application/json",
    "application/json; charset=latin-1",
    "text/plain",
    "",
    "multipart/form-data",
    "multipart/form-data; boundary=b",
    "application/x-www-form-urlencoded",
    "application/json;;",
]


def mutate_json(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """`value` with a few fields replaced, dropped, added, or nested past reason."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        value = dict(value)
        key = rng.choice(list(value))
        action = rng.randrange(4)
        if action == 0:
            value[key] = rng.choice(JUNK)
        elif action == 1:
            del value[key]
        elif action == 2:
            value[rng.choice(["n", "stream", "logprobs", "tools", "stop", "seed", "echo"])] = (
                rng.choice(JUNK)
            )
        else:
            value[key] = mutate_json(rng, value[key], depth + 1)
        return value
    if isinstance(value, list) and value and depth < 4:
        return [mutate_json(rng, item, depth + 1) for item in value]
    if rng.random() < 0.05:
        return nest(rng.choice([10, 1000, 100_000]))
    return rng.choice(JUNK)


def nest(depth: int) -> Any:
    return json.loads("[" * depth + "]" * depth) if depth < 500 else RawJson("[" * depth)


class RawJson(str):
    """JSON text sent as is (what json.dumps cannot write: depth past Python's recursion limit)."""


def json_body(rng: random.Random, value: Any) -> bytes:
    if isinstance(value, RawJson):
        return value.encode()
    for _ in range(rng.randrange(3)):
        value = mutate_json(rng, value)
    if isinstance(value, RawJson):
        return value.encode()
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
    return text.encode("utf-8", "surrogatepass")


def form_body(rng: random.Random, fields: dict[str, Any]) -> bytes:
    pairs = [(k, str(v)) for k, v in fields.items() if rng.random() < 0.9]
    if rng.random() < 0.5:
        pairs.append((rng.choice(list(fields)), str(rng.choice(JUNK))))
    text = "&".join(f"{k}={v}" for k, v in pairs)
    if rng.random() < 0.2:
        text += rng.choice(["&&", "%", "%zz", "=" * 5, "&a" * 100, "%ff%fe"])
    return text.encode("utf-8", "surrogatepass")


def headers_for(rng: random.Random, port: int, body: bytes, kind: str) -> list[tuple[str, str]]:
    headers = [("Host", f"127.0.0.1:{port}"), ("Connection", "close")]
    if kind:
        headers.append(("Content-Type", kind))
    length = str(len(body))
    if rng.random() < 0.15:
        length = rng.choice(["-1", "abc", "99999999999999999999", str(len(body) + 7), "0", "1,2"])
    headers.append(("Content-Length", length))
    for _ in range(rng.randrange(4) if rng.random() < 0.5 else 0):
        name, value = rng.choice(
            [
                ("Host", rng.choice(HOSTS)),
                ("Origin", rng.choice(ORIGINS)),
                ("Sec-Fetch-Site", rng.choice(["cross-site", "same-origin", "none", "?"])),
                ("Content-Type", rng.choice(TYPES)),
                ("Content-Length", str(rng.randrange(0, 1 << 22))),
                ("Authorization", rng.choice(["Bearer", "Bearer x", "Basic Zm9v", "bearer  "])),
                ("Transfer-Encoding", rng.choice(["chunked", "gzip", "identity"])),
                ("X-" + "a" * rng.randrange(1, 40), "v" * rng.randrange(0, 9000)),
                ("Cookie", "a=" + "b" * 100),
            ]
        )
        headers.append((name, value))
    return headers


def http_request(rng: random.Random, port: int) -> tuple[str, bytes, bool]:
    """A description of the case, the bytes of one request (mutated), and whether it is a whole
    request that the gateway should answer before it hangs up."""
    if rng.random() < 0.25:
        method, path, body, kind = (
            rng.choice(["GET", "HEAD", "OPTIONS", "POST"]),
            rng.choice(GETS),
            b"",
            "",
        )
    else:
        path, fields = rng.choice(POSTS)
        method = rng.choice(["POST"] * 8 + ["PUT", "GET"])
        as_form = path == "/api/v1/generate" and rng.random() < 0.4
        body = form_body(rng, fields) if as_form else json_body(rng, fields)
        kind = "application/x-www-form-urlencoded" if as_form else "application/json"
        if rng.random() < 0.15:
            kind = rng.choice(TYPES)
    if rng.random() < 0.2:
        path += "?" + form_body(rng, V1).decode("utf-8", "replace")
    headers = headers_for(rng, port, body, kind)
    whole = [(n, v) for n, v in headers if n in ("Content-Length", "Transfer-Encoding")] == [
        ("Content-Length", str(len(body)))
    ]
    if any(n == "Transfer-Encoding" and v == "chunked" for n, v in headers):
        headers = [(n, v) for n, v in headers if n != "Content-Length"]
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if rng.random() < 0.7 else body
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers)
    data = head.encode("utf-8", "surrogatepass") + b"\r\n" + body
    if rng.random() < 0.1:
        data, whole = mutate_bytes(rng, data), False
    return f"{method} {path[:60]} {kind} {len(body)} B", data, whole


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        where = rng.randrange(len(out) + 1)
        action = rng.randrange(4)
        if action == 0 and out:
            out[min(where, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif action == 1:
            out[where:where] = rng.choice(
                [b"\r\n", b"\x00", b"\xff", b":", b" ", b"{", b"\r\n\r\n"]
            )
        elif action == 2:
            del out[where:]
        else:
            out[where:where] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    return bytes(out)


def ws_frame(rng: random.Random, payload: bytes, opcode: int = 1) -> bytes:
    """A client frame (masked, as clients must), sometimes with its length or flags lying."""
    mask = os.urandom(4) if rng.random() < 0.9 else b""
    first = 0x80 | opcode
    if rng.random() < 0.1:
        first = rng.randrange(256)
    n = len(payload)
    if rng.random() < 0.05:
        n = rng.choice([0, 126, 1 << 30, (1 << 63) - 1])
    if n < 126:
        length = bytes([(0x80 if mask else 0) | n])
    elif n < 1 << 16:
        length = bytes([(0x80 if mask else 0) | 126]) + n.to_bytes(2, "big")
    else:
        length = bytes([(0x80 if mask else 0) | 127]) + n.to_bytes(8, "big")
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if mask else payload
    return bytes([first]) + length + mask + masked


def ws_exchange(rng: random.Random, port: int) -> tuple[str, bytes, bool]:
    """A v2 handshake (sometimes from another origin) and a few frames, mutated."""
    key = base64.b64encode(os.urandom(16)).decode()
    headers = [
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    ]
    refused = rng.random() < 0.1
    if refused:  # none of ORIGINS is this gateway's own
        headers.append(f"Origin: {rng.choice(ORIGINS)}")
    if rng.random() < 0.1:
        headers.append("Sec-WebSocket-Protocol: peerd, peerd.key.x")
    frames = []
    for message in (V2_OPEN, V2_GENERATE, {"type": "cancel"})[: rng.randrange(1, 4)]:
        payload = json_body(rng, message) if rng.random() < 0.7 else json.dumps(message).encode()
        if rng.random() < 0.1:
            payload = rng.choice([b"\xff\xfe", b"", b"[]", b"null", b"{" * 5000, b"x" * 70000])
        frames.append(ws_frame(rng, payload, opcode=rng.choice([1, 1, 1, 2, 8, 9, 10, 0, 3])))
    data = ("GET /api/v2/generate HTTP/1.1\r\n" + "\r\n".join(headers) + "\r\n\r\n").encode()
    data += b"".join(frames)
    if rng.random() < 0.2:
        data = data[: len(data) - len(frames[-1])] + mutate_bytes(rng, frames[-1])
    # A refused handshake is answered and closed; an accepted v2 socket waits for more messages
    # (300 s), so the client hangs up after its frames.
    return f"websocket {len(frames)} frames {len(data)} B", data, refused


# --- how it went --------------------------------------------------------------------------------


def exchange(port: int, data: bytes, whole: bool) -> bytes:
    """Send `data` and read until the gateway hangs up (it answers a whole request, with
    Connection: close, then hangs up); after a request that is not whole the client hangs up
    first, half-closing. TimeoutError past DEADLINE_S."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as conn:
        try:
            conn.sendall(data)
            if not whole:
                conn.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it hung up on garbage before reading it all: fine
        except OSError as e:  # ENOTCONN: it answered and hung up before our half-close
            if e.errno != errno.ENOTCONN:
                raise
        answer = bytearray()
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                chunk = conn.recv(1 << 16)
            except ConnectionResetError:
                return bytes(answer)
            if not chunk:
                return bytes(answer)
            answer += chunk
        raise TimeoutError(f"no hang-up within {DEADLINE_S} s; got {bytes(answer[:200])!r}")


def status_of(answer: bytes) -> str:
    if not answer:
        return "hang-up"
    return answer[9:12].decode("ascii", "replace") if answer.startswith(b"HTTP/1.") else "?"


def run_cases(
    port: int,
    errors: ErrorLog,
    n: int,
    make: Callable[[random.Random, int], tuple[str, bytes, bool]],
) -> tuple[Counter[str], float, str]:
    rng = random.Random(f"gateway-fuzz-{make.__name__}")
    statuses: Counter[str] = Counter()
    slowest, slowest_case = 0.0, ""
    for i in range(n):
        what, data, whole = make(rng, port)
        started = time.monotonic()
        answer = exchange(port, data, whole)
        took = time.monotonic() - started
        if took > slowest:
            slowest, slowest_case = took, what
        status = status_of(answer)
        statuses[status] += 1
        assert answer or not whole, f"case {i} ({what}): no answer to {data[:300]!r}"
        assert status != "500", f"case {i} ({what}) got 500: {answer[:1000]!r}\nsent {data[:300]!r}"
        assert not errors.records, f"case {i} ({what}) logged {errors.records[0].getMessage()}"
    return statuses, slowest, slowest_case


def test_mutated_http_requests_get_answers_never_crashes(gateway: tuple[int, ErrorLog]) -> None:
    port, errors = gateway
    started = time.monotonic()
    statuses, slowest, what = run_cases(port, errors, HTTP_CASES, http_request)
    took = time.monotonic() - started
    print(
        f"\n{HTTP_CASES} HTTP cases in {took:.1f} s; statuses {dict(statuses)}; "
        f"slowest {slowest * 1000:.0f} ms ({what})"
    )
    # The fuzz reached the routes, the guard and the daemon, not only the HTTP parser.
    for status in ("200", "400", "403", "415", "503"):
        assert statuses[status] > 0, (status, statuses)


def test_mutated_websocket_frames_never_crash(gateway: tuple[int, ErrorLog]) -> None:
    port, errors = gateway
    started = time.monotonic()
    statuses, slowest, what = run_cases(port, errors, WS_CASES, ws_exchange)
    took = time.monotonic() - started
    print(
        f"\n{WS_CASES} WebSocket cases in {took:.1f} s; statuses {dict(statuses)}; "
        f"slowest {slowest * 1000:.0f} ms ({what})"
    )
    assert statuses["101"] > WS_CASES // 2 and statuses["403"] > 0, statuses
