"""chat.petals.dev's APIs: POST /api/v1/generate (one generation per request) and the WebSocket
/api/v2/generate (an inference session that lives as long as the socket, so each turn sends only
its new tokens through the swarm: the servers' caches hold the rest).

Answers keep chat.petals.dev's shapes: {"ok": true, "outputs": ...} or {"ok": false, "traceback":
message}. Differences, all in docs/gateway.md: errors also carry an HTTP status (v1) and leave a v2
socket open for the next request; outputs never include the stop sequence; v2 takes `chat`,
`stream` and `seed`, and {"type": "cancel"} stops the generation in flight.
"""

from __future__ import annotations

import contextlib
from contextlib import aclosing
from typing import Any, Literal

import anyio
import anyio.lowlevel
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from peerd.gateway.bodies import (
    MAX_BODY_BYTES,
    parse_json_object,
    read_fields,
    too_large,
    until_disconnected,
    validate,
)
from peerd.gateway.guard import PAGE_PROTOCOL
from peerd.gateway.link import (
    DaemonLink,
    Done,
    GatewayError,
    ModelFacts,
    Piece,
    Sampling,
    daemon_error,
    run_generation,
)
from peerd.sdk.client import AsyncClient, PeerdError
from wire.local_api import (
    MAX_NEW_TOKENS,
    MAX_PROMPT_CHARS,
    MAX_STOP_LEN,
    MAX_STOP_SEQUENCES,
    MAX_TOKEN_ID,
)
from wire.peer_protocol import MAX_MODEL_LEN, MAX_SESSION_TOKENS, ErrorCode

IDLE_TIMEOUT_S = 300.0
"""A v2 socket that sends nothing for this long is closed and its session freed (chat.petals.dev's
STEP_TIMEOUT)."""

DAEMON_GONE = frozenset({ErrorCode.CONNECTION_CLOSED, ErrorCode.NO_DAEMON})

MAX_QUEUED_REQUESTS = 8
"""v2 requests a client may send ahead of the answers."""


def error_body(error: GatewayError) -> dict[str, Any]:
    return {"ok": False, "traceback": error.message, "code": error.code}


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status)


class _Sampling(BaseModel):
    """The sampling fields of both versions, as transformers' generate() takes them."""

    model_config = ConfigDict(extra="ignore")

    do_sample: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOKEN_ID)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    max_length: int | None = Field(default=None, ge=1, le=MAX_SESSION_TOKENS)
    max_new_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    seed: int | None = Field(default=None, ge=0, le=(1 << 64) - 1)
    # Speculative decoding (same output, fewer passes); a draft model is the daemon's operator's
    # choice (`peerd generate --speculate draft:PATH`), never a web page's: no path here.
    speculate: Literal["auto", "ngram", "off"] = "auto"

    def sampling(self, max_new_tokens: int, stop: tuple[str, ...] = ()) -> Sampling:
        greedy = not self.do_sample or self.temperature == 0.0 or self.top_p == 0.0
        return Sampling(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=self.temperature or 1.0,
            top_k=self.top_k or None,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            stop=stop,
            speculate=self.speculate,
        )


class V1Request(_Sampling):
    model: str | None = Field(default=None, max_length=MAX_MODEL_LEN)
    inputs: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    session_id: str | None = None


# --- v1 -------------------------------------------------------------------------------------


async def v1_generate(request: Request) -> Response:
    link: DaemonLink = request.app.state.link
    fields = {k: v for k, v in (await read_fields(request)).items() if v != "" or k == "inputs"}
    body = validate(V1Request, fields)
    if body.session_id is not None:
        raise GatewayError(
            400,
            "unsupported",
            "inference sessions over HTTP were removed from chat.petals.dev's API: use the "
            "WebSocket API /api/v2/generate",
            "session_id",
        )
    facts = await link.model(body.model)
    ids = await facts.encode(body.inputs)
    if body.max_new_tokens is not None:
        budget = body.max_new_tokens
    elif body.max_length is not None:
        budget = body.max_length - len(ids)
        if budget < 1:
            raise GatewayError(
                400,
                "context_length_exceeded",
                f"max_length ({body.max_length}) leaves no room after the {len(ids)} tokens of "
                "inputs",
                "max_length",
            )
    else:
        raise GatewayError(400, "invalid_request", "give max_new_tokens or max_length")
    facts.check_room(len(ids), budget)

    async def run() -> str:
        text = []
        async for item in link.generate(body.sampling(budget), facts, input_ids=ids):
            if isinstance(item, Piece):
                text.append(item.text)
        return "".join(text)

    return JSONResponse({"ok": True, "outputs": await until_disconnected(request, run)})


async def v1_models(request: Request) -> Response:
    """Every model a request may name (`model`): the daemon's own first (the default), then
    the swarm's others that are served in full and that the daemon can load."""
    link: DaemonLink = request.app.state.link
    own = await link.model()
    models = [{"name": own.name, "num_blocks": own.num_blocks, "default": True}]
    for m in await link.swarm_models():
        if m.name != own.name:
            models.append({"name": m.name, "num_blocks": m.num_blocks, "default": False})
    return JSONResponse({"ok": True, "models": models})


# --- v2 -------------------------------------------------------------------------------------


class V2Open(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["open_inference_session"]
    model: str | None = Field(default=None, max_length=MAX_MODEL_LEN)
    max_length: int = Field(ge=1, le=MAX_SESSION_TOKENS)


class V2Generate(_Sampling):
    type: Literal["generate"]
    inputs: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    stop_sequence: str | None = Field(default=None, min_length=1, max_length=MAX_STOP_LEN)
    extra_stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES - 1)
    chat: bool = False
    """Extension: `inputs` is the user's message; the daemon wraps it in the chat template."""
    stream: bool = False
    """Extension: send each piece as it comes even without a stop_sequence."""

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop_sequence] if self.stop_sequence else []
        for extra in self.extra_stop_sequences or ():
            if not 1 <= len(extra) <= MAX_STOP_LEN:
                raise GatewayError(
                    400,
                    "invalid_request",
                    f"each stop sequence must be 1 to {MAX_STOP_LEN} characters",
                    "extra_stop_sequences",
                )
            if extra not in stops:
                stops.append(extra)
        return tuple(stops)


async def v2_generate(websocket: WebSocket) -> None:
    # guard.py has checked Host, Origin and the API key. A browser that offers subprotocols (the
    # page does, to carry the key) needs one selected back.
    offered = websocket.scope.get("subprotocols", [])
    await websocket.accept(subprotocol=PAGE_PROTOCOL if PAGE_PROTOCOL in offered else None)
    async with anyio.create_task_group() as group:
        session = _V2Session(websocket, websocket.app.state.link, group.cancel_scope)
        group.start_soon(session.read)
        await session.serve()
        group.cancel_scope.cancel()
    if websocket.client_state == websocket.application_state == WebSocketState.CONNECTED:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            await websocket.close()


class _V2Session:
    """One v2 socket: its inference session on the daemon and what the servers' caches hold.
    Everything it runs lives in `scope`, cancelled when the client goes away."""

    def __init__(self, websocket: WebSocket, link: DaemonLink, scope: anyio.CancelScope) -> None:
        self.websocket = websocket
        self.link = link
        self.scope = scope
        self.inbox_in, self.inbox = anyio.create_memory_object_stream[
            dict[str, Any] | GatewayError
        ](MAX_QUEUED_REQUESTS)
        self.cancel_wanted = False
        self.max_length = 0
        self.position = 0
        """Tokens the session holds, counting the last sampled one (the daemon feeds it with the
        next turn)."""
        self.messages: list[dict[str, str]] = []
        """The chat so far, as the daemon holds it for `chat: true` turns."""

    async def read(self) -> None:
        """Take the client's messages in while a generation streams (so a cancel gets through);
        when the client goes away, cancel everything this socket runs."""
        try:
            async with self.inbox_in:
                while True:
                    message = await self.websocket.receive()
                    if message["type"] == "websocket.disconnect":
                        return
                    data = message.get("text")
                    if data is None:
                        data = message.get("bytes") or b""
                    request: dict[str, Any] | GatewayError
                    if len(data) > MAX_BODY_BYTES:
                        request = too_large("the message")
                    else:
                        try:
                            request = parse_json_object(data, "the message")
                        except GatewayError as e:
                            request = e
                    if isinstance(request, dict) and request.get("type") == "cancel":
                        self.cancel_wanted = True
                        continue
                    await self.inbox_in.send(request)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        finally:
            self.scope.cancel()

    async def send(self, data: dict[str, Any]) -> None:
        try:
            await self.websocket.send_json(data)
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.scope.cancel()  # the client is gone: unwind as a cancellation
            await anyio.lowlevel.checkpoint()

    async def next_request(self) -> dict[str, Any] | GatewayError | None:
        with anyio.move_on_after(IDLE_TIMEOUT_S):
            try:
                return await self.inbox.receive()
            except anyio.EndOfStream:
                return None
        return None

    async def serve(self) -> None:
        request = await self.next_request()
        if request is None:
            return
        try:
            if isinstance(request, GatewayError):
                raise request
            opening = validate(V2Open, request)
            facts = await self.link.model(opening.model)
            if opening.max_length > facts.context_length:
                raise GatewayError(
                    400,
                    "context_length_exceeded",
                    f"max_length {opening.max_length} is past {facts.name}'s context of "
                    f"{facts.context_length} tokens",
                    "max_length",
                )
            async with self.link.session_slot(), self.link.connect() as client:
                try:
                    session_id = await client.open_session(opening.max_length, model=facts.name)
                except PeerdError as e:
                    raise daemon_error(e) from e
                self.max_length = opening.max_length
                await self.send({"ok": True})
                await self._turns(client, session_id, facts)
        except GatewayError as e:  # the session could not open: chat.petals.dev hangs up too
            await self.send(error_body(e))

    async def _turns(self, client: AsyncClient, session_id: str, facts: ModelFacts) -> None:
        while (request := await self.next_request()) is not None:
            try:
                if isinstance(request, GatewayError):
                    raise request
                await self._generate(client, session_id, facts, validate(V2Generate, request))
            except GatewayError as e:
                await self.send(error_body(e))
                if e.code in DAEMON_GONE:
                    return  # the session died with the daemon connection

    async def _prompt(self, facts: ModelFacts, request: V2Generate) -> tuple[list[int], int]:
        """The token ids to send (none for a chat turn: the daemon applies the template) and
        how many tokens the session will hold once the prompt is in."""
        if request.chat:
            if not request.inputs:
                raise GatewayError(400, "invalid_request", "chat: true needs inputs", "inputs")
            turn = {"role": "user", "content": request.inputs}
            return [], len(await facts.encode_chat([*self.messages, turn]))
        first = self.position == 0
        ids = await facts.encode(request.inputs, add_special_tokens=first) if request.inputs else []
        if first and not ids:
            raise GatewayError(
                400, "invalid_request", "the session's first generate needs inputs", "inputs"
            )
        return ids, self.position + len(ids)

    def _budget(self, request: V2Generate, held: int) -> int:
        room = self.max_length - held
        if request.stop_sequence is not None:
            budget = room  # chat.petals.dev generates until the stop sequence
        elif request.max_new_tokens is not None:
            budget = request.max_new_tokens
        elif request.max_length is not None:
            budget = request.max_length - held
        else:
            raise GatewayError(
                400, "invalid_request", "give max_new_tokens, max_length or stop_sequence"
            )
        if not 1 <= budget <= room:
            asked = "" if request.stop_sequence is not None else f" and this turn asks for {budget}"
            raise GatewayError(
                400,
                "context_length_exceeded",
                f"the session has room for {max(room, 0)} more tokens after these inputs{asked}: "
                "open a session with a larger max_length",
                "max_new_tokens",
            )
        return budget

    async def _generate(
        self, client: AsyncClient, session_id: str, facts: ModelFacts, request: V2Generate
    ) -> None:
        self.cancel_wanted = False  # a cancel sent between generations stops nothing
        ids, held = await self._prompt(facts, request)
        sampling = request.sampling(self._budget(request, held), request.stops())
        stream = request.stop_sequence is not None or request.stream
        text: list[str] = []
        seen = 0
        done: Done | None = None
        cancel_sent = False
        try:
            async with aclosing(
                run_generation(
                    client,
                    sampling,
                    input_ids=ids or None,
                    prompt=request.inputs if request.chat else (None if ids else ""),
                    chat=request.chat,
                    session=session_id,
                )
            ) as generation:
                async for item in generation:
                    if self.cancel_wanted and not cancel_sent:
                        await client.request_cancel()
                        cancel_sent = True
                    if isinstance(item, Done):
                        done = item
                        break
                    text.append(item.text)
                    seen += item.tokens
                    if stream:
                        await self.send(
                            {
                                "ok": True,
                                "outputs": item.text,
                                "stop": False,
                                "token_count": item.tokens,
                            }
                        )
        finally:
            self.position = held + (done.total if done is not None else seen)
        assert done is not None
        if request.chat:
            turn = {"role": "user", "content": request.inputs or ""}
            self.messages += [turn, {"role": "assistant", "content": "".join(text)}]
        await self.send(
            {
                "ok": True,
                "outputs": "" if stream else "".join(text),
                "stop": True,
                "token_count": done.tokens if stream else done.total,
                "reason": done.reason,
            }
        )
