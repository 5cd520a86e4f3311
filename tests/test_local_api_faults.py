"""The local API's fault boundaries: a request that fails inside the daemon is answered with
Error(internal) and a logged traceback, and the daemon serves on; the accept loop rides out a
process that ran out of file descriptors. In-process over memory streams, then against a real
daemon on a checkpoint whose tokenizer has no chat template."""

from __future__ import annotations

import errno
import logging
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
import trio.testing

import wire
from peerd.bench.scale_real import build_tiny_model
from peerd.daemon.local_api import LocalApi
from peerd.devtools.localswarm import LocalSwarm
from peerd.session.inference import InferenceFailed
from routing.planner import NoRouteError


def _welcome() -> wire.Welcome:
    return wire.Welcome(
        version="0.1.0", peer_id="12D3KooWA", model="m", num_blocks=2, hidden_size=8
    )


def _status() -> wire.StatusResponse:
    return wire.StatusResponse(peer_id="12D3KooWA", version="0.1.0", uptime_s=1.0)


class _NoTemplateTokenizer:
    """Tokenizes plain text; has no chat template (as transformers says when asked for one)."""

    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
        return {"input_ids": [1 + ord(c) % 50 for c in text]}

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> list[int]:
        raise ValueError("Cannot use chat template functions: tokenizer.chat_template is not set")


async def _generator_without_template() -> Any:
    client = SimpleNamespace(tokenizer=_NoTemplateTokenizer())
    return SimpleNamespace(client=client, swarm=SimpleNamespace(model="m"))


class _Listener(trio.abc.Listener[trio.abc.Stream]):
    """Hands out the server ends of memory stream pairs; the first `emfile` accepts fail as
    accept(2) does when the process has no file descriptor left."""

    def __init__(self, emfile: int) -> None:
        self.emfile = emfile
        self.send, self.incoming = trio.open_memory_channel[trio.abc.Stream](8)

    async def connect(self, broken_reads: bool = False) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        await self.send.send(_BrokenReads(server) if broken_reads else server)
        return client

    async def accept(self) -> trio.abc.Stream:
        if self.emfile:
            self.emfile -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return await self.incoming.receive()

    async def aclose(self) -> None:
        await self.incoming.aclose()


class _BrokenReads(trio.abc.Stream):
    """A connection whose reads fail with an error the daemon expects nowhere."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        raise RuntimeError("a bug below the read loop")

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _ask(stream: trio.abc.Stream, *requests: wire.Message) -> list[wire.Message]:
    """Send `requests`, then read until as many final replies came back (Error, GenerateDone or
    one of the one-message answers)."""
    for request in requests:
        await stream.send_all(wire.encode_message(request))
    decoder = wire.MessageDecoder()
    replies: list[wire.Message] = []
    with trio.fail_after(30):
        while sum(not isinstance(r, wire.GeneratedToken) for r in replies) < len(requests):
            decoder.receive_data(await stream.receive_some(1 << 16))
            replies.extend(decoder)
    return replies


def _api(tmp_path: Path, get_generator: Any = _generator_without_template) -> LocalApi:
    return LocalApi(
        socket_path=tmp_path / "peerd.sock",
        get_generator=get_generator,
        status=_status,
        welcome=_welcome,
    )


async def test_accept_loop_rides_out_a_process_out_of_file_descriptors(tmp_path: Path) -> None:
    api = _api(tmp_path)
    listener = _Listener(emfile=3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(api.serve_listener, listener)
        stream = await listener.connect()
        replies = await _ask(stream, wire.Hello(), wire.StatusRequest())
        assert [type(r) for r in replies] == [wire.Welcome, wire.StatusResponse]
        assert listener.emfile == 0  # every failed accept was retried
        nursery.cancel_scope.cancel()


async def test_a_connection_whose_reads_fail_is_closed_with_an_internal_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = _api(tmp_path)
    listener = _Listener(emfile=0)
    with caplog.at_level(logging.ERROR, logger="peerd.daemon"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(api.serve_listener, listener)
            broken = await listener.connect(broken_reads=True)
            decoder = wire.MessageDecoder()
            with trio.fail_after(30):
                while data := await broken.receive_some():
                    decoder.receive_data(data)
            replies = await _ask(await listener.connect(), wire.StatusRequest())
            nursery.cancel_scope.cancel()
    [error] = list(decoder)
    assert isinstance(error, wire.Error) and error.code == wire.ErrorCode.INTERNAL
    assert "a bug below the read loop" in error.message
    assert [type(r) for r in replies] == [wire.StatusResponse]  # the next client is served
    assert api.connections == 0
    assert "RuntimeError: a bug below the read loop" in caplog.text  # with its traceback


async def test_a_request_that_fails_inside_the_daemon_gets_an_internal_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A chat request on a tokenizer without a chat template raises ValueError deep inside the
    daemon: that request gets Error(internal) naming it, the traceback goes to the log, and the
    connection and the daemon answer what comes next."""
    api = _api(tmp_path)
    listener = _Listener(emfile=0)
    chat = wire.Generate(prompt="hi", chat=True, max_new_tokens=2)
    with caplog.at_level(logging.ERROR, logger="peerd.daemon"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(api.serve_listener, listener)
            stream = await listener.connect()
            replies = await _ask(stream, wire.Hello(), chat, wire.StatusRequest())
            # A second connection is served as well.
            again = await _ask(await listener.connect(), wire.StatusRequest())
            nursery.cancel_scope.cancel()
    welcome, error, status = replies
    assert isinstance(welcome, wire.Welcome) and isinstance(status, wire.StatusResponse)
    assert isinstance(error, wire.Error) and error.code == wire.ErrorCode.INTERNAL
    assert "Generate" in error.message and "chat_template" in error.message
    assert [type(r) for r in again] == [wire.StatusResponse]
    logged = [r for r in caplog.records if r.exc_info is not None]
    assert len(logged) == 1 and isinstance(logged[0].exc_info[1], ValueError)  # type: ignore[index]


async def test_expected_failures_keep_their_own_codes(tmp_path: Path) -> None:
    """Refusals and the swarm's expected failures are not internal errors, also when a nursery
    wraps them in an exception group."""
    failures: list[Exception] = [
        NoRouteError("m", [(3, 5)], {}),
        ExceptionGroup("a nursery's", [InferenceFailed("every route for blocks 3-5 failed")]),
    ]

    async def failing_generator() -> Any:
        raise failures.pop(0)

    api = _api(tmp_path, failing_generator)
    listener = _Listener(emfile=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(api.serve_listener, listener)
        stream = await listener.connect()
        replies = await _ask(
            stream,
            wire.Generate(prompt="hi", max_new_tokens=1),
            wire.Generate(prompt="hi", max_new_tokens=1),
            wire.CloseInference(session_id="nope"),
            wire.StepResult(session_id="x", step_id=0, hidden_states=torch.zeros(1, 1, 2)),
        )
        nursery.cancel_scope.cancel()
    assert [r.code for r in replies if isinstance(r, wire.Error)] == [
        wire.ErrorCode.NO_ROUTE,
        wire.ErrorCode.INFERENCE_FAILED,
        wire.ErrorCode.SESSION_NOT_FOUND,
        wire.ErrorCode.BAD_REQUEST,
    ]
    assert "every route for blocks 3-5 failed" in replies[1].message  # type: ignore[attr-defined]


# --- against a real daemon ---------------------------------------------------------------------


def _exchange(path: Path, *requests: wire.Message) -> list[wire.Message]:
    """On a fresh connection: send `requests`, read until each has its final reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(120)
        sock.connect(str(path))
        sock.sendall(b"".join(bytes(wire.encode_message(r)) for r in requests))
        decoder = wire.MessageDecoder()
        replies: list[wire.Message] = []
        while sum(not isinstance(r, wire.GeneratedToken) for r in replies) < len(requests):
            chunk = sock.recv(1 << 16)
            assert chunk, f"the daemon hung up after {replies}"
            decoder.receive_data(chunk)
            replies.extend(decoder)
        return replies


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_real_daemon_answers_a_failing_chat_request_with_internal_and_serves_on(
    tmp_path: Path,
) -> None:
    model = build_tiny_model(tmp_path / "no-template", 2, chat_template=False)
    swarm = LocalSwarm(workdir=tmp_path)
    try:
        daemon = swarm.start("solo", "0:2", "--model", str(model))
        chat = wire.Generate(prompt="Hello there", chat=True, max_new_tokens=2)
        replies = _exchange(daemon.socket, chat)
        assert len(replies) == 1 and isinstance(replies[0], wire.Error), replies
        assert replies[0].code == wire.ErrorCode.INTERNAL
        assert "chat template" in replies[0].message or "chat_template" in replies[0].message
        # The same daemon, alive, generates for the next request.
        plain = wire.Generate(prompt="Once upon a time", max_new_tokens=3)
        replies = _exchange(daemon.socket, plain, wire.StatusRequest())
        done = [r for r in replies if isinstance(r, wire.GenerateDone)]
        assert len(done) == 1 and done[0].token_count >= 1 and done[0].reason in ("length", "eos")
        assert isinstance(replies[-1], wire.StatusResponse)
        assert replies[-1].serving is not None and replies[-1].serving.end == 2
        assert daemon.alive()
        assert "Traceback" in daemon.log_path.read_text()
    finally:
        swarm.stop()
