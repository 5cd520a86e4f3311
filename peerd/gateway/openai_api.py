"""The OpenAI-compatible API: /v1/models, /v1/chat/completions and /v1/completions, streamed as
server-sent events with `stream: true`, with usage counts and OpenAI-shaped errors.

Unsupported features that would change an answer (n > 1, logprobs, tools, JSON mode, penalties
other than 0) are refused with 400 rather than silently ignored. Extensions: top_k and
repetition_penalty, as vLLM and llama.cpp's servers take them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from peerd import __version__
from peerd.gateway.bodies import EventStream, event, read_json, until_disconnected, validate
from peerd.gateway.link import (
    DaemonLink,
    Done,
    GatewayError,
    ModelFacts,
    Piece,
    Sampling,
)
from wire.local_api import MAX_NEW_TOKENS, MAX_STOP_LEN, MAX_TOKEN_ID
from wire.peer_protocol import MAX_MODEL_LEN

MAX_STOP_SEQUENCES = 4
"""OpenAI's own limit on `stop`."""

MAX_MESSAGES = 4096
"""Messages in one chat request: a long conversation, far past any context length."""

DEFAULT_CHAT_MAX_TOKENS = 512
"""New tokens of a chat answer when the request names no limit (OpenAI's is the context): a long
answer, bounded so that a forgotten limit does not hold a slot for minutes."""

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions."""

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def error_response(error: GatewayError) -> JSONResponse:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return JSONResponse(
        {
            "error": {
                "message": error.message,
                "type": kind,
                "param": error.param,
                "code": error.code,
            }
        },
        status_code=error.status,
    )


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both completion endpoints take."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=MAX_MODEL_LEN)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOKEN_ID)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=(1 << 64) - 1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    user: str | None = None
    # Speculative decoding (peerd's extension, as repetition_penalty is vLLM's): no draft model
    # path from the web, see petals.py.
    speculate: Literal["auto", "ngram", "off"] = "auto"

    @model_validator(mode="after")
    def _supported(self) -> _Request:
        if self.n != 1:
            raise ValueError("only n=1 is supported: send one request per choice")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError(
                "presence_penalty and frequency_penalty are not supported: use repetition_penalty"
            )
        stops = self.stop_sequences()
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop takes at most {MAX_STOP_SEQUENCES} sequences")
        if any(not 1 <= len(s) <= MAX_STOP_LEN for s in stops):
            raise ValueError(f"each stop sequence must be 1 to {MAX_STOP_LEN} characters")
        return self

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self, max_new_tokens: int) -> Sampling:
        temperature = 1.0 if self.temperature is None else self.temperature
        greedy = temperature == 0.0 or self.top_p == 0.0
        return Sampling(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=temperature if not greedy else 1.0,
            top_k=self.top_k or None,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            stop=self.stop_sequences(),
            speculate=self.speculate,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported")
            parts.append(part.text)
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatRequest:
        if self.tools or self.functions:
            raise ValueError("tools and function calling are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        for message in self.messages:
            message.text()  # refuses non-text parts here, as a 400
        return self

    def conversation(self) -> list[dict[str, str]]:
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        prompts = self.prompt if isinstance(self.prompt, list) else [self.prompt]
        if not prompts:
            raise ValueError("prompt is empty")
        if isinstance(prompts[0], str) and len(prompts) > 1:
            raise ValueError("only one prompt per request is supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return self


def _link(request: Request) -> DaemonLink:
    link: DaemonLink = request.app.state.link
    return link


def _model_card(facts: ModelFacts) -> dict[str, Any]:
    return {"id": facts.name, "object": "model", "created": 0, "owned_by": "peerd"}


async def list_models(request: Request) -> Response:
    """The daemon's own model, then every other model of the swarm served in full."""
    names = await _link(request).model_names()
    cards = [{"id": n, "object": "model", "created": 0, "owned_by": "peerd"} for n in names]
    return JSONResponse({"object": "list", "data": cards})


async def get_model(request: Request) -> Response:
    facts = await _link(request).model(request.path_params["model"])
    return JSONResponse(_model_card(facts))


def _max_new_tokens(
    facts: ModelFacts, prompt_tokens: int, explicit: int | None, default: int
) -> int:
    room = facts.context_length - prompt_tokens
    if explicit is None:
        if room < 1:
            facts.check_room(prompt_tokens, 1, param="messages")
        return min(default, room)
    facts.check_room(prompt_tokens, explicit, param="max_tokens")
    return explicit


class _Completion:
    """One request's generation, shaped as OpenAI chat or text completion objects."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, echo: str = "") -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.echo = echo

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": f"{kind}.chunk" if chunk and self.chat else kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"peerd-{__version__}",
        }

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        reason = FINISH_REASONS[done.reason]
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {
                "index": 0,
                "text": self.echo + text,
                "logprobs": None,
                "finish_reason": reason,
            }
        return {**self._envelope(False), "choices": [choice], "usage": self.usage(done.total)}

    def chunk(
        self, text: str | None, finish_reason: str | None = None, *, first: bool = False
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update({"logprobs": None, "finish_reason": finish_reason})
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": self.usage(completion_tokens)}


async def chat_completions(request: Request) -> Response:
    link = _link(request)
    body = validate(ChatRequest, await read_json(request))
    facts = await link.model(body.model)
    ids = await facts.encode_chat(body.conversation())
    explicit = body.max_completion_tokens or body.max_tokens
    budget = _max_new_tokens(facts, len(ids), explicit, DEFAULT_CHAT_MAX_TOKENS)
    completion = _Completion(True, facts.name, len(ids))
    events = link.generate(body.sampling(budget), facts, input_ids=ids)
    return await _answer(request, body, completion, events)


async def completions(request: Request) -> Response:
    link = _link(request)
    body = validate(CompletionRequest, await read_json(request))
    facts = await link.model(body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        ids = [int(i) for i in prompt]
        vocabulary = len(facts.tokenizer)
        if any(not 0 <= i < vocabulary for i in ids):
            raise GatewayError(
                400, "invalid_request", f"token ids must be in [0, {vocabulary})", "prompt"
            )
        text = str(facts.tokenizer.decode(ids)) if body.echo else ""
    else:
        text = prompt if isinstance(prompt, str) else str(prompt[0])
        ids = await facts.encode(text)
        if not ids:
            raise GatewayError(400, "invalid_request", "prompt is empty", "prompt")
    budget = _max_new_tokens(facts, len(ids), body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
    completion = _Completion(False, facts.name, len(ids), echo=text if body.echo else "")
    events = link.generate(body.sampling(budget), facts, input_ids=ids)
    return await _answer(request, body, completion, events)


async def _answer(
    request: Request,
    body: _Request,
    completion: _Completion,
    events: AsyncGenerator[Piece | Done, None],
) -> Response:
    """Wait for the first token (so that a swarm that cannot serve answers with an HTTP error,
    not a broken stream), then answer whole or as server-sent events."""
    try:
        first = await until_disconnected(request, events.__anext__)
    except BaseException:
        await events.aclose()
        raise
    if body.stream:
        return EventStream(_stream(completion, body.include_usage, first, events))

    async def rest() -> tuple[str, Done]:
        text: list[str] = []
        async with aclosing(events):
            async for item in _chain(first, events):
                if isinstance(item, Piece):
                    text.append(item.text)
                else:
                    return "".join(text), item
        raise GatewayError(502, "inference_failed", "the daemon ended the generation early")

    text, done = await until_disconnected(request, rest)
    return JSONResponse(completion.whole(text, done))


async def _chain(
    first: Piece | Done, events: AsyncIterator[Piece | Done]
) -> AsyncIterator[Piece | Done]:
    yield first
    if not isinstance(first, Done):
        async for item in events:
            yield item


async def _stream(
    completion: _Completion,
    include_usage: bool,
    first: Piece | Done,
    events: AsyncGenerator[Piece | Done, None],
) -> AsyncGenerator[str, None]:
    async with aclosing(events):
        if completion.chat:
            yield event(completion.chunk(None, first=True))
        elif completion.echo:
            yield event(completion.chunk(completion.echo))
        try:
            async for item in _chain(first, events):
                if isinstance(item, Piece):
                    yield event(completion.chunk(item.text))
                    continue
                yield event(completion.chunk(None, FINISH_REASONS[item.reason]))
                if include_usage:
                    yield event(completion.usage_chunk(item.total))
                break
        except GatewayError as e:
            # Headers are gone: the error travels as an event, which OpenAI clients raise.
            yield event({"error": {"message": e.message, "type": "server_error", "code": e.code}})
        yield event("[DONE]")
