"""The client library: talk to the local peerd daemon over its Unix socket.

    from peerd.sdk.client import Client
    with Client() as client:
        for piece in client.generate("Once upon a time", max_new_tokens=32, stream=True):
            print(piece, end="", flush=True)

`AsyncClient` offers the same calls as coroutines on anyio, so it works under trio and asyncio
alike (web frameworks included). Errors the daemon reports raise `PeerdError`.

Both take routing controls for every generation and session they start (see `route_options`):
    Client(allowed_servers=["12D3KooW..."], blocked_servers=[...], max_retries=2,
           connect_timeout=5, request_timeout=30, show_route=True)
"""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

import wire
from peerd import __version__
from peerd.paths import default_socket_path

READ_CHUNK = 1 << 16
DEFAULT_TIMEOUT_S = 300.0


class PeerdError(Exception):
    """The daemon refused or failed a request; `code` is machine-readable (wire.ErrorCode)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class DaemonNotRunning(PeerdError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            "no_daemon",
            f"no peerd daemon answers on {path} ({reason}); start one with "
            "`peerd start --new-swarm` (or `--initial-peers MULTIADDR` to join a swarm), or "
            "point to its socket with --socket / PEERD_SOCKET",
        )


class BadRouteOptions(PeerdError, ValueError):
    """Routing controls the daemon would refuse: a malformed peer id, a negative timeout..."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_request", message)


def route_options(
    *,
    allowed_servers: Iterable[str] | None = None,
    blocked_servers: Iterable[str] = (),
    max_retries: int | None = None,
    connect_timeout: float | None = None,
    request_timeout: float | None = None,
) -> wire.RouteOptions | None:
    """Routing controls for the daemon (None when all are the defaults).

    allowed_servers: use only these peers (ids as `peerd status` shows them); blocked_servers:
    never use these; max_retries: failed servers to replace before failing; connect_timeout:
    seconds to dial a hop and open its session; request_timeout: seconds each step may take.
    Raises BadRouteOptions naming a malformed peer id.
    """
    if isinstance(allowed_servers, str) or isinstance(blocked_servers, str):
        raise BadRouteOptions("allowed_servers and blocked_servers take a list of peer ids")
    try:
        options = wire.RouteOptions(
            allowed_servers=None if allowed_servers is None else tuple(allowed_servers),
            blocked_servers=tuple(blocked_servers),
            max_retries=max_retries,
            connect_timeout=None if connect_timeout is None else float(connect_timeout),
            request_timeout=None if request_timeout is None else float(request_timeout),
        )
    except (wire.ProtocolError, ValueError, TypeError) as e:
        raise BadRouteOptions(str(e)) from e
    return None if options == wire.RouteOptions() else options


def print_route(route: Iterable[str], out: Any = None) -> None:
    """The route a generation or session used, as show_route prints it (to stderr)."""
    print("route: " + (" -> ".join(route) or "(none)"), file=out or sys.stderr, flush=True)


@dataclass
class GenerateOptions:
    """Sampling and stopping settings of one generation (see wire.Generate)."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    active_adapter: str | None = None  # a LoRA adapter the servers apply (None: the base model)

    def options(self) -> dict[str, Any]:
        """Keyword arguments for generate/stream_tokens. Sampling settings are dropped for
        greedy decoding, so a caller's temperature=0 ("greedy") is not an error."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            "temperature": self.temperature if self.do_sample else 1.0,
            "top_k": self.top_k if self.do_sample else None,
            "top_p": self.top_p if self.do_sample else None,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": tuple(self.stop),
            "active_adapter": self.active_adapter,
        }


@dataclass
class Generation:
    """What one finished generation gave."""

    text: str
    token_ids: list[int]
    reason: str


def socket_path(path: str | Path | None) -> Path:
    import os

    if path is not None:
        return Path(path)
    if env := os.environ.get("PEERD_SOCKET"):
        return Path(env)
    return default_socket_path()


def _generate_request(
    prompt: str | list[str] | None,
    input_ids: list[int] | None,
    chat: bool,
    session_id: str | None,
    options: GenerateOptions,
    routing: wire.RouteOptions | None = None,
) -> wire.Generate:
    try:
        return wire.Generate(
            prompt=prompt if isinstance(prompt, str) else None,
            prompts=tuple(prompt) if isinstance(prompt, list | tuple) else None,
            input_ids=tuple(input_ids) if input_ids is not None else None,
            max_new_tokens=options.max_new_tokens,
            do_sample=options.do_sample,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            repetition_penalty=options.repetition_penalty,
            seed=options.seed,
            stop=tuple(options.stop),
            chat=chat,
            session_id=session_id,
            active_adapter=options.active_adapter,
            routing=routing,
        )
    except (ValueError, TypeError) as e:
        raise PeerdError("bad_request", str(e)) from e


def _open_request(
    max_length: int,
    batch_size: int,
    active_adapter: str | None,
    routing: wire.RouteOptions | None = None,
    left_padding: tuple[int, ...] = (),
) -> wire.OpenInference:
    try:
        return wire.OpenInference(
            max_length=max_length,
            batch_size=batch_size,
            active_adapter=active_adapter,
            routing=routing,
            left_padding=tuple(left_padding),
        )
    except (ValueError, TypeError) as e:
        raise PeerdError("bad_request", str(e)) from e


def _rows(prompt: str | list[str] | None) -> int:
    """How many GenerateDone messages end a request for `prompt` (one per row of a batch)."""
    return len(prompt) if isinstance(prompt, list | tuple) else 1


def _add(results: list[Generation], message: wire.GeneratedToken | wire.GenerateDone) -> None:
    """Add a token or an ending to the Generation of its row."""
    result = results[message.row]
    if isinstance(message, wire.GeneratedToken):
        result.text += message.text
        result.token_ids.append(message.token_id)
    else:
        result.reason = message.reason


def _collect(
    messages: Iterator[wire.GeneratedToken | wire.GenerateDone], rows: int
) -> list[Generation]:
    """Each row's text, token ids and reason from a stream of GeneratedToken / GenerateDone."""
    results = [Generation("", [], "") for _ in range(rows)]
    for message in messages:
        _add(results, message)
    return results


HELLO = wire.Hello(client=f"peerd.client {__version__}")


def _hung_up(path: Path) -> PeerdError:
    return PeerdError("connection_closed", f"the daemon on {path} hung up")


def _check_reply(answer: wire.Message, reply: type[Any]) -> Any:
    if not isinstance(answer, reply):
        raise PeerdError("bad_reply", f"expected {reply.__name__}, got {type(answer).__name__}")
    return answer


def _token_or_done(message: wire.Message) -> wire.GeneratedToken | wire.GenerateDone:
    if not isinstance(message, wire.GeneratedToken | wire.GenerateDone):
        raise PeerdError("bad_reply", f"expected a token, got {type(message).__name__}")
    return message


def _raise_if_error(message: wire.Message) -> wire.Message:
    if isinstance(message, wire.Error):
        raise PeerdError(message.code, message.message)
    return message


class _RouteControls:
    """What Client and AsyncClient share: the routing controls they send with each request, and
    the route the last generation or session used."""

    def __init__(self, show_route: bool, routing: dict[str, Any]) -> None:
        self.routing = route_options(**routing)
        self.show_route = show_route
        self.last_route: tuple[str, ...] = ()

    def _route_used(self, route: tuple[str, ...]) -> None:
        self.last_route = route
        if self.show_route:
            print_route(route)


class Client(_RouteControls):
    """A synchronous connection to the local daemon. Use as a context manager.

    `routing` keywords (route_options) apply to every generation and session it starts;
    show_route=True prints each one's route to stderr."""

    def __init__(
        self,
        path: str | Path | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        show_route: bool = False,
        **routing: Any,
    ) -> None:
        _RouteControls.__init__(self, show_route, routing)
        self.path = socket_path(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(self.path))
        except OSError as e:
            self._sock.close()
            raise DaemonNotRunning(self.path, e.strerror or str(e)) from None
        self._decoder = wire.MessageDecoder()
        self.welcome = self._request(HELLO, wire.Welcome)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def _send(self, message: wire.Message) -> None:
        self._sock.sendall(wire.encode_message(message))

    def _receive(self) -> wire.Message:
        while True:
            message = self._decoder.next_message()
            if message is not None:
                return _raise_if_error(message)
            data = self._sock.recv(READ_CHUNK)
            if not data:
                raise _hung_up(self.path)
            self._decoder.receive_data(data)

    def _request(self, message: wire.Message, reply: type[Any]) -> Any:
        self._send(message)
        return _check_reply(self._receive(), reply)

    def status(self) -> wire.StatusResponse:
        return self._request(wire.StatusRequest(), wire.StatusResponse)

    def stream_tokens(
        self,
        prompt: str | list[str] | None = None,
        *,
        input_ids: list[int] | None = None,
        chat: bool = False,
        session: str | None = None,
        **options: Any,
    ) -> Generator[wire.GeneratedToken | wire.GenerateDone, None, None]:
        """Every GeneratedToken as it is sampled, then the GenerateDone. With a list of prompts
        (a batch, one inference session), each message carries its `row` and every row ends
        with its own GenerateDone. Closing the generator early cancels the generation."""
        self._send(
            _generate_request(
                prompt, input_ids, chat, session, GenerateOptions(**options), self.routing
            )
        )
        rows_left = _rows(prompt)
        try:
            while rows_left:
                try:
                    message = _token_or_done(self._receive())
                except PeerdError:
                    rows_left = 0  # the daemon ended this request with an error
                    raise
                if isinstance(message, wire.GenerateDone):
                    rows_left -= 1
                    self._route_used(message.route)
                yield message
        finally:
            if rows_left:
                self.cancel(rows_left)

    def cancel(self, rows: int = 1) -> None:
        """Stop the generation in flight and wait for its GenerateDone (one per row left)."""
        self._send(wire.Cancel())
        while rows:
            rows -= isinstance(self._receive(), wire.GenerateDone)

    def generate(
        self, prompt: str | list[str] | None = None, *, stream: bool = False, **kwargs: Any
    ) -> Any:
        """The generated text, or with stream=True an iterator of text pieces as they arrive
        (never half a UTF-8 character). kwargs: input_ids, chat, session and GenerateOptions.
        A list of prompts is generated as one batch and gives a list of texts (no stream)."""
        if isinstance(prompt, list):
            return [g.text for g in self.generate_batch(prompt, **kwargs)]
        pieces = self._pieces(prompt, **kwargs)
        return pieces if stream else "".join(pieces)

    def generate_batch(self, prompts: list[str], **kwargs: Any) -> list[Generation]:
        """Each prompt's generation, all in one inference session (left-padded rows, each
        stopping at its own end of sequence or stop sequence). kwargs: chat and GenerateOptions."""
        return _collect(self.stream_tokens(list(prompts), **kwargs), len(prompts))

    def _pieces(self, prompt: str | None, **kwargs: Any) -> Iterator[str]:
        for message in self.stream_tokens(prompt, **kwargs):
            if isinstance(message, wire.GeneratedToken) and message.text:
                yield message.text

    def generate_full(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        return _collect(self.stream_tokens(prompt, **kwargs), 1)[0]

    # --- inference sessions -----------------------------------------------------------------

    def open_session(
        self,
        max_length: int,
        batch_size: int = 1,
        active_adapter: str | None = None,
        left_padding: tuple[int, ...] = (),
    ) -> str:
        """A session through the swarm (with LoRA `active_adapter` on every hop when given;
        `left_padding`: per row, padding positions at its start); `last_route` lists its hops."""
        opened = self._request(
            _open_request(max_length, batch_size, active_adapter, self.routing, left_padding),
            wire.InferenceOpened,
        )
        self._route_used(opened.route)
        return str(opened.session_id)

    def step(self, session: str, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states after the embeddings -> hidden states after the last block."""
        output = self._request(
            wire.InferenceStep(session_id=session, hidden_states=hidden_states),
            wire.InferenceOutput,
        )
        return output.hidden_states

    def close_session(self, session: str) -> None:
        self._request(wire.CloseInference(session_id=session), wire.InferenceClosed)

    # --- training ---------------------------------------------------------------------------

    def training_forward(
        self, hidden_states: torch.Tensor, prompts: torch.Tensor | None = None, keep: bool = True
    ) -> wire.TrainingOutput:
        """A cache-less pass through every block (deep `prompts`: [blocks, batch or 1, prefix,
        hidden]); with `keep`, its `forward_id` names it for one training_backward."""
        return self._request(
            wire.TrainingForward(hidden_states=hidden_states, prompts=prompts, keep=keep),
            wire.TrainingOutput,
        )

    def training_backward(
        self, forward_id: str, grad_outputs: torch.Tensor
    ) -> wire.TrainingGradients:
        """Gradients of a kept training_forward's inputs and prompts, given its outputs'."""
        return self._request(
            wire.TrainingBackward(forward_id=forward_id, grad_outputs=grad_outputs),
            wire.TrainingGradients,
        )


class AsyncClient(_RouteControls):
    """The same calls as Client, as coroutines on anyio (trio or asyncio)."""

    def __init__(
        self, path: str | Path | None = None, *, show_route: bool = False, **routing: Any
    ) -> None:
        _RouteControls.__init__(self, show_route, routing)
        self.path = socket_path(path)
        self._stream: anyio.abc.ByteStream | None = None
        self._decoder = wire.MessageDecoder()
        self._lock = anyio.Lock()
        self.welcome: wire.Welcome | None = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        try:
            self._stream = await anyio.connect_unix(str(self.path))
        except OSError as e:
            raise DaemonNotRunning(self.path, e.strerror or str(e)) from None
        self.welcome = await self._request(
            wire.Hello(client=f"peerd.client {__version__}"), wire.Welcome
        )

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def _send(self, message: wire.Message) -> None:
        assert self._stream is not None, "connect() first"
        await self._stream.send(bytes(wire.encode_message(message)))

    async def _receive(self) -> wire.Message:
        assert self._stream is not None, "connect() first"
        while True:
            message = self._decoder.next_message()
            if message is not None:
                return _raise_if_error(message)
            try:
                data = await self._stream.receive(READ_CHUNK)
            except anyio.EndOfStream:
                raise PeerdError(
                    "connection_closed", f"the daemon on {self.path} hung up"
                ) from None
            self._decoder.receive_data(data)

    async def _request(self, message: wire.Message, reply: type[Any]) -> Any:
        await self._send(message)
        return _check_reply(await self._receive(), reply)

    async def status(self) -> wire.StatusResponse:
        return await self._request(wire.StatusRequest(), wire.StatusResponse)

    async def stream_tokens(
        self,
        prompt: str | list[str] | None = None,
        *,
        input_ids: list[int] | None = None,
        chat: bool = False,
        session: str | None = None,
        **options: Any,
    ) -> AsyncIterator[wire.GeneratedToken | wire.GenerateDone]:
        await self._send(
            _generate_request(
                prompt, input_ids, chat, session, GenerateOptions(**options), self.routing
            )
        )
        rows_left = _rows(prompt)
        try:
            while rows_left:
                try:
                    message = _token_or_done(await self._receive())
                except PeerdError:
                    rows_left = 0  # the daemon ended this request with an error
                    raise
                if isinstance(message, wire.GenerateDone):
                    rows_left -= 1
                    self._route_used(message.route)
                yield message
        finally:
            if rows_left and self._stream is not None:
                with anyio.CancelScope(shield=True):
                    await self.cancel(rows_left)

    async def cancel(self, rows: int = 1) -> None:
        await self._send(wire.Cancel())
        while rows:
            rows -= isinstance(await self._receive(), wire.GenerateDone)

    async def generate_batch(self, prompts: list[str], **kwargs: Any) -> list[Generation]:
        """Each prompt's generation, all in one inference session (see Client.generate_batch)."""
        results = [Generation("", [], "") for _ in prompts]
        async for message in self.stream_tokens(list(prompts), **kwargs):
            _add(results, message)
        return results

    async def request_cancel(self) -> None:
        """Ask the daemon to stop the generation in flight, from another task than the one
        iterating stream_tokens: that iterator still gets the tokens sampled meanwhile, then
        GenerateDone("cancelled") with the true token count."""
        await self._send(wire.Cancel())

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> str:
        pieces = [piece async for piece in self.stream(prompt, **kwargs)]
        return "".join(pieces)

    async def stream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[str]:
        """Text pieces as they are sampled (never half a UTF-8 character)."""
        async for message in self.stream_tokens(prompt, **kwargs):
            if isinstance(message, wire.GeneratedToken) and message.text:
                yield message.text

    async def open_session(
        self,
        max_length: int,
        batch_size: int = 1,
        active_adapter: str | None = None,
        left_padding: tuple[int, ...] = (),
    ) -> str:
        opened = await self._request(
            _open_request(max_length, batch_size, active_adapter, self.routing, left_padding),
            wire.InferenceOpened,
        )
        self._route_used(opened.route)
        return str(opened.session_id)

    async def step(self, session: str, hidden_states: torch.Tensor) -> torch.Tensor:
        output = await self._request(
            wire.InferenceStep(session_id=session, hidden_states=hidden_states),
            wire.InferenceOutput,
        )
        return output.hidden_states

    async def close_session(self, session: str) -> None:
        await self._request(wire.CloseInference(session_id=session), wire.InferenceClosed)

    async def training_forward(
        self, hidden_states: torch.Tensor, prompts: torch.Tensor | None = None, keep: bool = True
    ) -> wire.TrainingOutput:
        return await self._request(
            wire.TrainingForward(hidden_states=hidden_states, prompts=prompts, keep=keep),
            wire.TrainingOutput,
        )

    async def training_backward(
        self, forward_id: str, grad_outputs: torch.Tensor
    ) -> wire.TrainingGradients:
        return await self._request(
            wire.TrainingBackward(forward_id=forward_id, grad_outputs=grad_outputs),
            wire.TrainingGradients,
        )
