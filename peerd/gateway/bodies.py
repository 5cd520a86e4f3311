"""HTTP plumbing shared by the gateway's APIs: request bodies read within a size limit, validation
errors a person can act on, server-sent events, and work that stops when its client goes away."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import anyio
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from peerd.gateway.link import GatewayError

MAX_BODY_BYTES = 2 << 20
"""A request body or WebSocket message. An 8k-token context (the default model's) is ~40 KB of
English and a 128k one ~0.5 MB; 2 MiB leaves room for JSON escaping and long chat transcripts
while a client cannot make the gateway buffer more than that per request."""

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready (nobody to answer)."""


def too_large(what: str) -> GatewayError:
    return GatewayError(
        413,
        "request_too_large",
        f"{what} is larger than the gateway's limit of {MAX_BODY_BYTES} bytes",
    )


async def read_body(request: Request) -> bytes:
    """The whole body, refusing (413) before buffering more than MAX_BODY_BYTES."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > MAX_BODY_BYTES:
                raise too_large("the request body")
        except ValueError:
            raise GatewayError(400, "invalid_request", "bad Content-Length header") from None
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise too_large("the request body")
    except ClientDisconnect:  # it went away before sending the whole body: nobody to answer
        raise ClientGone() from None
    return bytes(body)


def parse_json_object(data: bytes | str, what: str = "the request body") -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise GatewayError(400, "invalid_json", f"{what} is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...: Python's parser recurses once per level
        raise GatewayError(400, "invalid_json", f"{what} nests too deep") from None
    if not isinstance(value, dict):
        raise GatewayError(400, "invalid_json", f"{what} must be a JSON object")
    return value


FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def unsupported_type(kind: str, accepted: str) -> GatewayError:
    """415 for a body that does not say what it is. A JSON body as text/plain, or with no type,
    is what a web page of another site can send without asking the browser first (a "simple"
    request), so the gateway takes JSON only as application/json."""
    given = f"Content-Type {kind}" if kind else "no Content-Type"
    return GatewayError(415, "unsupported_media_type", f"the body has {given}: send {accepted}")


async def read_json(request: Request) -> dict[str, Any]:
    if content_type(request) != "application/json":
        raise unsupported_type(content_type(request), "JSON with Content-Type: application/json")
    body = await read_body(request)
    if not body.strip():
        raise GatewayError(400, "invalid_json", "the request has no body: send a JSON object")
    return parse_json_object(body)


async def read_fields(request: Request) -> dict[str, Any]:
    """Query parameters plus the body's fields, whether JSON, urlencoded or multipart form (what
    Flask's request.values gave chat.petals.dev, and JSON besides)."""
    fields: dict[str, Any] = dict(request.query_params)
    body = await read_body(request)
    kind = content_type(request)
    if body and kind != "application/json" and kind not in FORM_TYPES:
        raise unsupported_type(kind, "Content-Type: application/json or a form")
    if kind == "application/json":
        fields.update(parse_json_object(body))
    elif kind == "multipart/form-data":

        async def replay() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        form = await Request(request.scope, replay).form(max_files=0, max_fields=64)
        for key, value in form.multi_items():
            if not isinstance(value, UploadFile):
                fields[key] = value
    elif body:
        try:
            text = body.decode()
        except UnicodeDecodeError:
            raise GatewayError(400, "invalid_request", "the form is not UTF-8") from None
        try:
            fields.update(parse_qsl(text, keep_blank_values=True, max_num_fields=64))
        except ValueError as e:
            raise GatewayError(400, "invalid_request", f"bad form: {e}") from None
    return fields


def validate(model: type[M], fields: dict[str, Any]) -> M:
    """`fields` as `model`, or a 400 naming the first bad field and what is wrong with it."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(error: ValidationError) -> GatewayError:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return GatewayError(
        400, "invalid_request", f"{where}: {message}" if where else message, where or None
    )


async def until_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """`await work()`, cancelled (ClientGone) if the HTTP client disconnects first."""
    outcome: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            outcome.append(await work())
        except Exception as e:  # raised below, as itself: a task group would wrap it in a group
            failure.append(e)
        group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not outcome:
        raise ClientGone()
    return outcome[0]


def event(data: Any) -> str:
    """One server-sent event carrying `data` as JSON (or a bare string such as [DONE])."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that always finishes its source: when the client goes away
    mid-stream, the source's cleanup (cancelling the generation on the daemon, closing the
    connection, freeing the servers' caches) runs before the request ends."""

    def __init__(self, source: AsyncGenerator[str, None]) -> None:
        self.source = source
        super().__init__(
            source,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.source.aclose()
