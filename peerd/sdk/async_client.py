"""AsyncClient, the one source of both clients: the local API's calls as coroutines on anyio
(trio or asyncio). sync_client.py is generated from this file by `python -m peerd.sdk.unasync`
(tests/test_sdk_client.py fails when the two differ), so edit here and regenerate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Self

import torch

import wire
from peerd.sdk.errors import PeerdError
from peerd.sdk.options import (
    DEFAULT_TIMEOUT_S,
    GenerateOptions,
    Generation,
    RouteControls,
    generate_request,
    open_request,
    socket_path,
)
from peerd.sdk.replies import (
    HELLO,
    Answer,
    AsyncTokenStream,
    check_reply,
    collect,
    hung_up,
    raise_if_error,
    rows_of,
    token_or_done,
)
from peerd.sdk.transport import AsyncTransport


class AsyncClient(RouteControls):
    """A connection to the local daemon; use it as a context manager, which connects.

    `timeout`: seconds to connect and to wait for each message (TimeoutError). `routing`
    keywords (route_options) apply to every generation and session it starts; show_route=True
    prints each one's route to stderr. Generation keywords (`**options`) are GenerateOptions'
    fields, laid over `options=` when both are given."""

    def __init__(
        self,
        path: str | Path | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        show_route: bool = False,
        **routing: Any,
    ) -> None:
        RouteControls.__init__(self, show_route, routing)
        self.path = socket_path(path)
        self.timeout = timeout
        self._transport: AsyncTransport | None = None
        self._decoder = wire.MessageDecoder()
        self._welcome: wire.Welcome | None = None

    async def __aenter__(self) -> Self:
        if self._transport is None:
            await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        """Connect and greet the daemon. Raises DaemonNotRunning when none answers."""
        self._transport = await AsyncTransport.connect(self.path, self.timeout)
        self._decoder = wire.MessageDecoder()
        self._welcome = await self._request(HELLO, wire.Welcome)

    async def aclose(self) -> None:
        if self._transport is not None:
            transport, self._transport = self._transport, None
            await transport.aclose()

    @property
    def welcome(self) -> wire.Welcome:
        """What the daemon runs, as it said when this client connected."""
        if self._welcome is None:
            raise PeerdError(wire.ErrorCode.CONNECTION_CLOSED, f"not connected to {self.path}")
        return self._welcome

    def _connected(self) -> AsyncTransport:
        if self._transport is None:
            raise PeerdError(wire.ErrorCode.CONNECTION_CLOSED, f"not connected to {self.path}")
        return self._transport

    async def _send(self, message: wire.Message) -> None:
        await self._connected().send(bytes(wire.encode_message(message)))

    async def _receive(self) -> wire.Message:
        """The next message; the daemon's Error raises PeerdError."""
        transport = self._connected()
        while (message := self._decoder.next_message()) is None:
            data = await transport.receive()
            if not data:
                raise hung_up(self.path)
            self._decoder.receive_data(data)
        return raise_if_error(message)

    async def _request(self, message: wire.Message, reply: type[Answer]) -> Answer:
        await self._send(message)
        return check_reply(await self._receive(), reply)

    async def status(self) -> wire.StatusResponse:
        return await self._request(wire.StatusRequest(), wire.StatusResponse)

    async def models(self) -> list[wire.SwarmModel]:
        """The models served in the swarm as the daemon knows them, its own first; generate with
        one by name (`model=`). A model is ready when `blocks_served == num_blocks` and the
        daemon has its `checkpoint`."""
        return list((await self.status()).models)

    # --- generation -------------------------------------------------------------------------

    async def stream_tokens(
        self,
        prompt: str | list[str] | None = None,
        *,
        input_ids: list[int] | None = None,
        chat: bool = False,
        session: str | None = None,
        options: GenerateOptions | None = None,
        **kwargs: Any,
    ) -> AsyncTokenStream:
        """Every GeneratedToken as it is sampled, then the GenerateDone. With a list of prompts
        (a batch, one inference session), each message carries its `row` and every row ends
        with its own GenerateDone. Closing the iterator early cancels the generation."""
        options = GenerateOptions.merged(options, kwargs)
        await self._send(generate_request(prompt, input_ids, chat, session, options, self.routing))
        rows_left = rows_of(prompt)
        try:
            while rows_left:
                try:
                    message = token_or_done(await self._receive())
                except PeerdError:
                    rows_left = 0  # the daemon ended this request with an error
                    raise
                if isinstance(message, wire.GenerateDone):
                    rows_left -= 1
                    self._route_used(message.route)
                yield message
        finally:
            if rows_left and self._transport is not None:
                with self._transport.shielded():
                    await self.cancel(rows_left)

    async def cancel(self, rows: int = 1) -> None:
        """Stop the generation in flight and wait for its GenerateDone (one per row left)."""
        await self._send(wire.Cancel())
        while rows:
            rows -= isinstance(await self._receive(), wire.GenerateDone)

    async def request_cancel(self) -> None:
        """Ask the daemon to stop the generation in flight, from another task (or thread) than
        the one iterating stream_tokens: that iterator still gets the tokens sampled meanwhile,
        then GenerateDone("cancelled") with the true token count."""
        await self._send(wire.Cancel())

    async def stream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[str]:
        """Text pieces as they are sampled (never half a UTF-8 character). kwargs: as
        stream_tokens takes them."""
        async for message in self.stream_tokens(prompt, **kwargs):
            if isinstance(message, wire.GeneratedToken) and message.text:
                yield message.text

    async def generate(
        self, prompt: str | list[str] | None = None, *, stream: bool = False, **kwargs: Any
    ) -> Any:
        """The generated text, or with stream=True the `stream` of its pieces. kwargs: as
        stream_tokens takes them. A list of prompts is generated as one batch and gives a list
        of texts (no stream)."""
        if isinstance(prompt, list):
            return [g.text for g in await self.generate_batch(prompt, **kwargs)]
        if stream:
            return self.stream(prompt, **kwargs)
        return "".join([piece async for piece in self.stream(prompt, **kwargs)])

    async def generate_full(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        """The whole Generation (text, token ids, reason) of one prompt."""
        return collect([m async for m in self.stream_tokens(prompt, **kwargs)], 1)[0]

    async def generate_batch(self, prompts: list[str], **kwargs: Any) -> list[Generation]:
        """Each prompt's generation, all in one inference session (left-padded rows, each
        stopping at its own end of sequence or stop sequence)."""
        messages = [m async for m in self.stream_tokens(list(prompts), **kwargs)]
        return collect(messages, len(prompts))

    # --- inference sessions -----------------------------------------------------------------

    async def open_session(
        self,
        max_length: int,
        batch_size: int = 1,
        active_adapter: str | None = None,
        left_padding: tuple[int, ...] = (),
        model: str | None = None,
    ) -> str:
        """A session through the swarm (with LoRA `active_adapter` on every hop when given;
        `left_padding`: per row, padding positions at its start; `model`: a model of the swarm
        by name, None: the daemon's); `last_route` lists its hops."""
        opened = await self._request(
            open_request(max_length, batch_size, active_adapter, self.routing, left_padding, model),
            wire.InferenceOpened,
        )
        self._route_used(opened.route)
        return str(opened.session_id)

    async def step(self, session: str, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states after the embeddings -> hidden states after the last block."""
        output = await self._request(
            wire.InferenceStep(session_id=session, hidden_states=hidden_states),
            wire.InferenceOutput,
        )
        return output.hidden_states

    async def close_session(self, session: str) -> None:
        await self._request(wire.CloseInference(session_id=session), wire.InferenceClosed)

    # --- training ---------------------------------------------------------------------------

    async def training_forward(
        self, hidden_states: torch.Tensor, prompts: torch.Tensor | None = None, keep: bool = True
    ) -> wire.TrainingOutput:
        """A cache-less pass through every block (deep `prompts`: [blocks, batch or 1, prefix,
        hidden]); with `keep`, its `forward_id` names it for one training_backward."""
        return await self._request(
            wire.TrainingForward(hidden_states=hidden_states, prompts=prompts, keep=keep),
            wire.TrainingOutput,
        )

    async def training_backward(
        self, forward_id: str, grad_outputs: torch.Tensor
    ) -> wire.TrainingGradients:
        """Gradients of a kept training_forward's inputs and prompts, given its outputs'."""
        return await self._request(
            wire.TrainingBackward(forward_id=forward_id, grad_outputs=grad_outputs),
            wire.TrainingGradients,
        )
