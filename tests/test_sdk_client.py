"""The client library against a fake daemon: Client and AsyncClient are one source (the sync one
generated from the async one), so both have the same calls and behave the same way: streaming,
cancelling, timeouts, a daemon hanging up mid-stream, and the sampling record they send.

The fake daemon is a thread on a Unix socket in tmp_path that speaks the local API with wire
messages and plays a script per connection; nothing here waits on a clock except the timeout
tests, whose daemon never answers at all (their 1 s is for connecting on a loaded machine)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import aclosing, closing
from pathlib import Path

import pytest
import trio

import wire
from peerd.sdk import unasync
from peerd.sdk.client import AsyncClient, Client, GenerateOptions, PeerdError
from peerd.sdk.transport import AsyncTransport

WELCOME = wire.Welcome(version="0", peer_id="fake", model="fake-model", num_blocks=2, hidden_size=4)
ROUTE = ("12D3KooWfake[0:2)",)
WORDS = ("Once", " upon", " a", " time")


class Peer:
    """The daemon's side of one connection."""

    def __init__(
        self, conn: socket.socket, received: list[wire.Message], never: threading.Event
    ) -> None:
        self.conn = conn
        self.received = received
        self.never = never  # what a silent daemon waits for: set when the test ends
        self.decoder = wire.MessageDecoder()

    def receive(self) -> wire.Message:
        while (message := self.decoder.next_message()) is None:
            data = self.conn.recv(1 << 16)
            if not data:
                raise EOFError
            self.decoder.receive_data(data)
        self.received.append(message)
        return message

    def send(self, *messages: wire.Message) -> None:
        for message in messages:
            self.conn.sendall(wire.encode_message(message))


Script = Callable[[Peer], None]


class FakeDaemon:
    """Greets every connection (Hello -> Welcome), then plays `script` on it."""

    def __init__(self, path: Path, script: Script) -> None:
        self.path = path
        self.script = script
        self.received: list[wire.Message] = []
        self.never = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed: the test is over
            with conn:
                conn.settimeout(60)  # a broken test fails rather than hangs
                peer = Peer(conn, self.received, self.never)
                try:
                    assert isinstance(peer.receive(), wire.Hello)
                    peer.send(WELCOME)
                    self.script(peer)
                except (EOFError, OSError):
                    pass

    def requests(self, kind: type[wire.Message]) -> list[wire.Message]:
        return [m for m in self.received if isinstance(m, kind)]

    def close(self) -> None:
        self.never.set()
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        self.listener.close()
        self.thread.join(timeout=60)


def tokens_then_done(rows: int, reason: str = "length") -> list[wire.Message]:
    out: list[wire.Message] = []
    for row in range(rows):
        out += [wire.GeneratedToken(text=w, token_id=i, row=row) for i, w in enumerate(WORDS)]
        out.append(wire.GenerateDone(reason=reason, token_count=len(WORDS), route=ROUTE, row=row))
    return out


def answers(peer: Peer) -> None:
    """Answers every request as a daemon would: a generation in full, status, a session."""
    while True:
        request = peer.receive()
        if isinstance(request, wire.Generate):
            peer.send(*tokens_then_done(len(request.prompts or ("",))))
        elif isinstance(request, wire.StatusRequest):
            peer.send(wire.StatusResponse(peer_id="fake", version="0", uptime_s=1.0))
        elif isinstance(request, wire.OpenInference):
            peer.send(wire.InferenceOpened(session_id="s1", route=ROUTE))


def waits_for_cancel(peer: Peer) -> None:
    """Sends the first tokens, then ends the generation only when Cancel comes; then answers."""
    assert isinstance(peer.receive(), wire.Generate)
    peer.send(*tokens_then_done(1)[:3])
    assert isinstance(peer.receive(), wire.Cancel)
    peer.send(wire.GenerateDone(reason="cancelled", token_count=3, route=ROUTE))
    answers(peer)


def hangs_up_mid_stream(peer: Peer) -> None:
    peer.receive()
    peer.send(*tokens_then_done(1)[:1])


def refuses(peer: Peer) -> None:
    peer.receive()
    peer.send(wire.Error(code=wire.ErrorCode.NO_ROUTE, message="no peer serves blocks 0-1"))
    answers(peer)


@pytest.fixture
def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(tmp_path / "peerd.sock", getattr(request, "param", answers))
    try:
        yield fake
    finally:
        fake.close()


def scripted(script: Script) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("daemon", [script], indirect=True)


# --- one source ------------------------------------------------------------------------------

SYNC_NAME = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
DUNDERS = ("__init__", "__aenter__", "__aexit__", "__enter__", "__exit__")  # __init__: timeout


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, callable)
        if not name.startswith("_") or name in DUNDERS
    }


def test_every_call_of_one_client_exists_on_the_other_with_the_same_parameters() -> None:
    async_calls = public_methods(AsyncClient)
    sync_calls = public_methods(Client)
    assert {SYNC_NAME.get(name, name) for name in async_calls} == set(sync_calls)
    for name, signature in async_calls.items():
        sync_signature = sync_calls[SYNC_NAME.get(name, name)]
        assert [(p.name, p.kind, p.default) for p in signature.parameters.values()] == [
            (p.name, p.kind, p.default) for p in sync_signature.parameters.values()
        ], name
    for name in ("generate", "generate_full", "generate_batch", "stream", "request_cancel"):
        assert name in sync_calls  # the calls that had drifted apart


def test_the_sync_client_is_generated_from_the_async_one() -> None:
    assert unasync.TARGET.read_text() == unasync.unasync(unasync.SOURCE.read_text()), (
        "peerd/sdk/sync_client.py is out of date: run `python -m peerd.sdk.unasync`"
    )
    assert unasync.main(["--check"]) == 0


def test_unasync_rewrites_the_async_words_only() -> None:
    source = '"""doc"""\nasync def aclose(self) -> AsyncIterator[int]:\n    await self.aclosing()\n'
    assert unasync.unasync(source).endswith(
        "def close(self) -> Iterator[int]:\n    self.aclosing()\n"
    )


def test_sdk_imports_without_libp2p() -> None:
    code = (
        "import sys\n"
        "sys.modules['libp2p'] = None  # any import of libp2p now raises ImportError\n"
        "import peerd.sdk, peerd.sdk.client, peerd.sdk.model, peerd.sdk.terminal\n"
        "import peerd.client, peerd.model\n"
        "import pkgutil, importlib\n"
        "for m in pkgutil.iter_modules(peerd.sdk.__path__):\n"
        "    importlib.import_module('peerd.sdk.' + m.name)\n"
        "print('imported')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr


# --- streaming -------------------------------------------------------------------------------


def test_sync_client_streams_generates_and_batches(daemon: FakeDaemon) -> None:
    with Client(daemon.path) as client:
        assert client.welcome == WELCOME
        messages = list(client.stream_tokens("Hi", max_new_tokens=4))
        assert [m.text for m in messages[:-1]] == list(WORDS)  # type: ignore[union-attr]
        assert messages[-1] == tokens_then_done(1)[-1] and client.last_route == ROUTE
        assert client.generate("Hi") == "".join(WORDS)
        assert list(client.generate("Hi", stream=True)) == list(WORDS)
        full = client.generate_full("Hi")
        assert (full.text, full.token_ids, full.reason) == ("".join(WORDS), [0, 1, 2, 3], "length")
        assert client.generate(["a", "b"]) == ["".join(WORDS)] * 2
        assert [g.reason for g in client.generate_batch(["a", "b", "c"])] == ["length"] * 3
        assert client.status().peer_id == "fake"
        assert client.open_session(16) == "s1"


async def test_async_client_streams_generates_and_batches(daemon: FakeDaemon) -> None:
    async with AsyncClient(daemon.path) as client:
        assert client.welcome == WELCOME
        messages = [m async for m in client.stream_tokens("Hi", max_new_tokens=4)]
        assert [m.text for m in messages[:-1]] == list(WORDS)  # type: ignore[union-attr]
        assert messages[-1] == tokens_then_done(1)[-1] and client.last_route == ROUTE
        assert await client.generate("Hi") == "".join(WORDS)
        assert [p async for p in await client.generate("Hi", stream=True)] == list(WORDS)
        full = await client.generate_full("Hi")
        assert (full.text, full.token_ids, full.reason) == ("".join(WORDS), [0, 1, 2, 3], "length")
        assert await client.generate(["a", "b"]) == ["".join(WORDS)] * 2
        assert [g.reason for g in await client.generate_batch(["a", "b", "c"])] == ["length"] * 3
        assert (await client.status()).peer_id == "fake"
        assert await client.open_session(16) == "s1"


# --- cancelling ------------------------------------------------------------------------------


@scripted(waits_for_cancel)
def test_sync_stream_closed_early_cancels_and_the_connection_goes_on(daemon: FakeDaemon) -> None:
    with Client(daemon.path) as client:
        with closing(client.stream_tokens("Hi")) as tokens:
            assert next(tokens).text == WORDS[0]  # type: ignore[union-attr]
        assert len(daemon.requests(wire.Cancel)) == 1
        assert client.status().peer_id == "fake"  # the cancelled tokens were all read


@scripted(waits_for_cancel)
async def test_async_stream_closed_early_cancels_and_the_connection_goes_on(
    daemon: FakeDaemon,
) -> None:
    async with AsyncClient(daemon.path) as client:
        async with aclosing(client.stream_tokens("Hi")) as tokens:
            async for message in tokens:
                assert message.text == WORDS[0]  # type: ignore[union-attr]
                break
        assert len(daemon.requests(wire.Cancel)) == 1
        assert (await client.status()).peer_id == "fake"


@scripted(waits_for_cancel)
def test_sync_request_cancel_ends_the_stream_with_every_token_sent(daemon: FakeDaemon) -> None:
    with Client(daemon.path) as client:
        tokens = client.stream_tokens("Hi")
        first = next(tokens)
        client.request_cancel()
        rest = list(tokens)
        assert [first, *rest] == [*tokens_then_done(1)[:3], rest[-1]]
        assert rest[-1] == wire.GenerateDone(reason="cancelled", token_count=3, route=ROUTE)


@scripted(waits_for_cancel)
async def test_async_request_cancel_from_another_task(daemon: FakeDaemon) -> None:
    async with AsyncClient(daemon.path) as client:
        got: list[wire.Message] = []
        first_token = trio.Event()

        async def read() -> None:
            async for message in client.stream_tokens("Hi"):
                got.append(message)
                first_token.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await first_token.wait()
            await client.request_cancel()
        assert got == [*tokens_then_done(1)[:3], got[-1]]
        assert got[-1] == wire.GenerateDone(reason="cancelled", token_count=3, route=ROUTE)


# --- failures --------------------------------------------------------------------------------


def silent(peer: Peer) -> None:
    peer.receive()
    peer.never.wait(60)  # never answers (bounded so that a broken test cannot hang)


@scripted(silent)
def test_sync_client_times_out_waiting_for_a_silent_daemon(daemon: FakeDaemon) -> None:
    with Client(daemon.path, timeout=1.0) as client, pytest.raises(TimeoutError):
        client.generate("Hi")


@scripted(silent)
async def test_async_client_times_out_waiting_for_a_silent_daemon(daemon: FakeDaemon) -> None:
    async with AsyncClient(daemon.path, timeout=1.0) as client:
        with pytest.raises(TimeoutError):
            await client.generate("Hi")


@scripted(hangs_up_mid_stream)
def test_sync_client_reports_a_daemon_that_hangs_up_mid_stream(daemon: FakeDaemon) -> None:
    with Client(daemon.path) as client, pytest.raises(PeerdError) as error:
        client.generate("Hi")
    assert error.value.code == wire.ErrorCode.CONNECTION_CLOSED


@scripted(hangs_up_mid_stream)
async def test_async_client_reports_a_daemon_that_hangs_up_mid_stream(daemon: FakeDaemon) -> None:
    async with AsyncClient(daemon.path) as client:
        with pytest.raises(PeerdError) as error:
            await client.generate("Hi")
    assert error.value.code == wire.ErrorCode.CONNECTION_CLOSED


@scripted(refuses)
def test_sync_client_raises_the_daemons_error_and_goes_on(daemon: FakeDaemon) -> None:
    with Client(daemon.path) as client:
        with pytest.raises(PeerdError) as error:
            client.generate("Hi")
        assert error.value.code == wire.ErrorCode.NO_ROUTE
        assert client.generate("Hi") == "".join(WORDS)


@scripted(refuses)
async def test_async_client_raises_the_daemons_error_and_goes_on(daemon: FakeDaemon) -> None:
    async with AsyncClient(daemon.path) as client:
        with pytest.raises(PeerdError) as error:
            await client.generate("Hi")
        assert error.value.code == wire.ErrorCode.NO_ROUTE
        assert await client.generate("Hi") == "".join(WORDS)


def test_no_daemon_is_reported_by_both_clients(tmp_path: Path) -> None:
    with pytest.raises(PeerdError) as sync_error:
        Client(tmp_path / "nothing.sock")

    async def connect() -> None:
        async with AsyncClient(tmp_path / "nothing.sock"):
            pass

    with pytest.raises(PeerdError) as async_error:
        trio.run(connect)
    assert sync_error.value.code == async_error.value.code == wire.ErrorCode.NO_DAEMON


# --- sampling --------------------------------------------------------------------------------


def test_the_sampling_record_goes_to_the_daemon_as_given(daemon: FakeDaemon) -> None:
    options = GenerateOptions(max_new_tokens=7, do_sample=True, temperature=0.5, top_k=4)
    with Client(daemon.path) as client:
        client.generate("Hi", options=options, seed=3)  # a keyword lays itself over options
        client.generate("Hi", temperature=0.0)  # greedy: sampling settings are not sent
    sampled, greedy = daemon.requests(wire.Generate)
    assert sampled.max_new_tokens == 7  # type: ignore[attr-defined]
    assert sampled.sampling == wire.Sampling(  # type: ignore[attr-defined]
        do_sample=True, temperature=0.5, top_k=4, seed=3
    )
    assert greedy.sampling == wire.Sampling()  # type: ignore[attr-defined]


def test_bad_sampling_is_refused_before_anything_is_sent(daemon: FakeDaemon) -> None:
    with Client(daemon.path) as client, pytest.raises(PeerdError) as error:
        client.generate("Hi", do_sample=True, temperature=0.0)
    assert error.value.code == wire.ErrorCode.BAD_REQUEST and "temperature" in str(error.value)
    assert daemon.requests(wire.Generate) == []


def test_a_receive_cancelled_as_data_arrives_on_asyncio_logs_no_loop_error(tmp_path: Path) -> None:
    """The gateway runs AsyncTransport on asyncio, and cancels a receive whenever its client
    hangs up. A receive cancelled in the loop turn its data arrives must leave the event loop
    nothing to choke on (anyio's raw UNIX socket wait logged InvalidStateError there)."""
    path = tmp_path / "d.sock"

    async def main() -> list[dict[str, object]]:
        loop = asyncio.get_running_loop()
        errors: list[dict[str, object]] = []
        loop.set_exception_handler(lambda _, context: errors.append(context))
        peers: list[asyncio.StreamWriter] = []
        server = await asyncio.start_unix_server(lambda _, w: peers.append(w), str(path))
        transport = await AsyncTransport.connect(path, 5.0)
        for _ in range(20):
            receiving = asyncio.ensure_future(transport.receive())
            while not peers:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.01)  # the receive waits on the socket
            peers[0].write(b"x")  # in the client's socket now: readable at the next poll,
            loop.call_soon(receiving.cancel)  # in the turn that cancels the receive
            with contextlib.suppress(asyncio.CancelledError):
                await receiving
            await asyncio.sleep(0.01)
        await transport.aclose()
        server.close()
        return errors

    assert asyncio.run(main()) == []
