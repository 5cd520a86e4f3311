"""Generate requests of the local API: one prompt (alone, or a turn of a chat session) or a batch
of prompts, sampled through the swarm and streamed back a token at a time.

Every row of a generation, a single prompt included, goes through one loop: its text grows with
each token (RowText) and it ends on end-of-sequence, a stop sequence, max_new_tokens or Cancel. A
Cancel may arrive before its Generate started (a Ctrl-C at once on a busy daemon); Generations
remembers it for the next one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Literal

import torch
import trio

import wire
from peerd.daemon.api_session import ApiError, ApiSession, turn_ids
from peerd.session.drafting import DraftModelError
from peerd.session.generation import Generator, encode_prompt, left_pad
from peerd.session.inference import InferenceSession
from peerd.session.speculative import Speculation, parse_speculate
from routing.planner import route_hops

Reason = Literal["length", "stop", "eos", "cancelled"]


class Generations:
    """The Generate requests of one connection, run one at a time, and the Cancels for them."""

    def __init__(self, send: Callable[[wire.Message], Awaitable[None]]) -> None:
        self._send = send
        self._running: trio.CancelScope | None = None
        # Generate requests read but not started yet, and whether a Cancel came for the next one.
        self._queued = 0
        self._cancel_queued = False

    def queue(self) -> None:
        """A Generate was read; it runs once the requests ahead of it are answered."""
        self._queued += 1

    def cancel(self) -> None:
        """The client sent Cancel: stop the generation running, or else the next one."""
        if self._running is not None:
            self._running.cancel()
        elif self._queued:
            self._cancel_queued = True

    def stop(self) -> None:
        """Stop the generation running, if any (its client hung up or broke the framing)."""
        if self._running is not None:
            self._running.cancel()

    async def run(
        self,
        request: wire.Generate,
        load: Callable[[str | None], Awaitable[Generator]],
        find_session: Callable[[str], ApiSession],
    ) -> None:
        """Answer one Generate: GeneratedToken per token, GenerateDone per row. `load` gives
        the generator of the model it names, `find_session` the client's session of an id."""
        try:
            session = find_session(request.session_id) if request.session_id else None
            model = request.model
            if model is None and session is not None:  # a session's turns run its own model
                model = session.inference.swarm.model
            generator = await load(model)
            if session is not None and session.inference.swarm is not generator.swarm:
                raise ApiError(
                    wire.ErrorCode.BAD_REQUEST,
                    f"session {request.session_id} runs {session.inference.swarm.model}, not "
                    f"{generator.swarm.model}: name its model or none",
                )
            params = request.sampling  # validated when the request was decoded
            if request.prompts is not None:
                await self._batch(request, generator, params)
                return
            await self._one(request, generator, params, session)
        finally:
            self._queued -= 1
            self._cancel_queued = False

    @contextlib.contextmanager
    def _cancellable(self) -> Iterator[trio.CancelScope]:
        with trio.CancelScope() as scope:
            self._running = scope
            if self._cancel_queued:  # the client cancelled before we started
                scope.cancel()
            try:
                yield scope
            finally:
                self._running = None

    async def _one(
        self,
        request: wire.Generate,
        generator: Generator,
        params: wire.Sampling,
        session: ApiSession | None,
    ) -> None:
        """One prompt, in a session of its own or as the next turn of the client's session."""
        tokenizer = generator.client.tokenizer
        _check_adapter(request, session)
        new_ids = turn_ids(tokenizer, request, session)
        _check_vocabulary(new_ids, generator.client.embeddings.num_embeddings)
        if session is not None:
            _check_room(session, len(new_ids), request.max_new_tokens)
        row = RowText(tokenizer, request.stop, generator.client.eos_token_ids)
        route: tuple[str, ...] = ()
        with self._cancellable() as scope:
            async with contextlib.AsyncExitStack() as own:
                if session is not None:
                    inference = session.inference
                else:  # a session of this generation's own, routed as the request asks
                    opened = _session_for(request, generator, len(new_ids))
                    inference = await own.enter_async_context(opened)
                prompt = torch.tensor([new_ids], dtype=torch.long)
                try:
                    await self._stream(request, generator, params, inference, prompt, [row])
                finally:
                    route = route_hops(inference.route)  # where it ended, after any failover
        if session is not None:
            _record_turn(session, request, new_ids, row)
        reason: Reason = "cancelled" if scope.cancelled_caught else (row.reason or "length")
        await self._send(wire.GenerateDone(reason=reason, token_count=len(row.tokens), route=route))

    async def _batch(
        self, request: wire.Generate, generator: Generator, params: wire.Sampling
    ) -> None:
        """Every prompt of request.prompts in one inference session, left-padded; each row's
        tokens stream with its row index and it ends on its own (EOS, a stop sequence)."""
        assert request.prompts is not None
        tokenizer = generator.client.tokenizer
        eos = generator.client.eos_token_ids
        encoded = [
            encode_prompt(tokenizer, text, chat=request.chat)[0].tolist()
            for text in request.prompts
        ]
        if not all(encoded):
            raise ApiError(wire.ErrorCode.BAD_REQUEST, "a prompt of the batch encodes to no tokens")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [0])[0]
        prompt, padding = left_pad(encoded, int(pad_id))
        rows = [RowText(tokenizer, request.stop, eos) for _ in encoded]
        route: tuple[str, ...] = ()
        with self._cancellable() as scope:
            inference = _session_for(
                request, generator, prompt.shape[1], batch_size=len(rows), left_padding=padding
            )
            async with inference:
                try:
                    await self._stream(
                        request, generator, params, inference, prompt, rows, self._row_done
                    )
                finally:
                    route = route_hops(inference.route)
        last: Reason = "cancelled" if scope.cancelled_caught else "length"
        for index, row in enumerate(rows):
            if row.reason is None:
                done = wire.GenerateDone(
                    reason=last, token_count=len(row.tokens), row=index, route=route
                )
                await self._send(done)

    async def _row_done(self, index: int, row: RowText) -> None:
        assert row.reason is not None
        await self._send(
            wire.GenerateDone(reason=row.reason, token_count=len(row.tokens), row=index)
        )

    async def _stream(
        self,
        request: wire.Generate,
        generator: Generator,
        params: wire.Sampling,
        inference: InferenceSession,
        prompt: torch.Tensor,
        rows: list[RowText],
        row_done: Callable[[int, RowText], Awaitable[None]] | None = None,
    ) -> None:
        """Sample through `inference` until every row ended or max_new_tokens, sending each
        row's tokens as they come (and `row_done` for a row that ends before the others)."""
        stream = generator.generate(
            prompt,
            request.max_new_tokens,
            params,
            session=inference,
            eos_token_ids=rows[0].eos,
            speculate=_speculation(request),
        )
        # Closed as soon as we stop reading: a speculative pass may have run past the last token
        # sent, and the session's caches are rolled back to it before a next turn is recorded.
        with _draft_model_errors():
            async with contextlib.aclosing(stream):
                async for tokens in stream:
                    for index, row in enumerate(rows):
                        if row.reason is not None:
                            continue  # ended: its later samples are nobody's
                        token_id = int(tokens[index, 0])
                        text = row.add(token_id)
                        await self._send(
                            wire.GeneratedToken(text=text, token_id=token_id, row=index)
                        )
                        if row.reason is not None and row_done is not None:
                            await row_done(index, row)
                    if all(row.reason is not None for row in rows):
                        break


@contextlib.contextmanager
def _draft_model_errors() -> Iterator[None]:
    try:
        yield
    except DraftModelError as e:  # the request's draft model: its client's to fix
        raise ApiError(wire.ErrorCode.BAD_REQUEST, str(e)) from e


def _speculation(request: wire.Generate) -> Speculation:
    """The request's speculative decoding, its draft model loaded (refused with what to do
    when it cannot be)."""
    try:
        return parse_speculate(request.speculate, request.speculate_tokens)
    except ValueError as e:
        raise ApiError(wire.ErrorCode.BAD_REQUEST, str(e)) from e


def _session_for(
    request: wire.Generate, generator: Generator, prompt_length: int, **shape: Any
) -> InferenceSession:
    """A session of a generation's own, long enough for its prompt and new tokens."""
    try:
        return InferenceSession(
            generator.swarm,
            max_length=prompt_length + request.max_new_tokens,
            adapter=request.active_adapter,
            routing=request.routing,
            open_with_first_step=True,
            **shape,
        )
    except ValueError as e:
        raise ApiError(wire.ErrorCode.BAD_REQUEST, str(e)) from e


def _check_vocabulary(ids: list[int], vocabulary: int) -> None:
    """A program's token ids must name tokens of the model (the embedding look-up would fail)."""
    if ids and max(ids) >= vocabulary:
        raise ApiError(
            wire.ErrorCode.BAD_REQUEST,
            f"token id {max(ids)} is not in the model's vocabulary: send ids below {vocabulary}",
        )


def _check_adapter(request: wire.Generate, session: ApiSession | None) -> None:
    if session is not None and request.active_adapter not in (None, session.inference.adapter):
        raise ApiError(
            wire.ErrorCode.BAD_REQUEST,
            f"session {request.session_id} runs with adapter {session.inference.adapter!r}, "
            f"not {request.active_adapter!r}: open another session for that adapter",
        )


def _check_room(session: ApiSession, new_tokens: int, max_new_tokens: int) -> None:
    room = session.inference.max_length - session.inference.position
    if new_tokens + max_new_tokens > room:
        raise ApiError(
            wire.ErrorCode.OUT_OF_CACHE,
            f"the session has room for {room} more tokens; this turn needs "
            f"{new_tokens} + {max_new_tokens}: open a longer session",
        )


def _record_turn(
    session: ApiSession, request: wire.Generate, new_ids: list[int], row: RowText
) -> None:
    """What the session's caches hold after a turn, and the answer as the chat's next message."""
    # Every token but the last sampled one went through the blocks.
    session.fed += new_ids + row.tokens[:-1]
    session.pending = row.tokens[-1:]
    if request.chat:
        session.messages.append({"role": "assistant", "content": row.emitted})


class RowText:
    """The text of one generated sequence as its tokens arrive, and why it ended (None: it goes
    on): an end-of-sequence token, or a stop sequence (the text is cut before it)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], eos: list[int]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.eos = eos
        self.tokens: list[int] = []
        self.emitted = ""  # the text sent so far
        self.reason: Literal["stop", "eos"] | None = None

    def add(self, token_id: int) -> str:
        """The text this token adds ("" at EOS and mid-character)."""
        self.tokens.append(token_id)
        if token_id in self.eos:
            self.reason = "eos"
            return ""
        text = str(self.tokenizer.decode(self.tokens, skip_special_tokens=True))
        if text.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
            return ""
        cut = find_stop(text, self.stops, len(self.emitted))
        if cut is not None:
            self.reason = "stop"
            text = text[:cut]
        piece = text[len(self.emitted) :]
        self.emitted = text
        return piece


def find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop sequence starts in `text`, looking only where a new match
    can be (it must end after `emitted`)."""
    best: int | None = None
    for stop in stops:
        index = text.find(stop, max(0, emitted - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
