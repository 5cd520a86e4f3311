"""What the daemon answers, checked: the reply a request expects, a generation's tokens and
endings, and a whole generation gathered from them (shared by both clients)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Iterable
from pathlib import Path
from typing import Any, TypeVar

import wire
from peerd import __version__
from peerd.sdk.errors import PeerdError
from peerd.sdk.options import Generation

HELLO = wire.Hello(client=f"peerd.client {__version__}")

Answer = TypeVar("Answer", bound=wire.Message)

AsyncTokenStream = AsyncGenerator[wire.GeneratedToken | wire.GenerateDone, None]
"""What stream_tokens gives: the tokens of a generation, then its ending (one per row)."""
TokenStream = Generator[wire.GeneratedToken | wire.GenerateDone, None, None]


def hung_up(path: Path) -> PeerdError:
    return PeerdError(wire.ErrorCode.CONNECTION_CLOSED, f"the daemon on {path} hung up")


def raise_if_error(message: wire.Message) -> wire.Message:
    """`message`, unless it is the daemon's Error: then PeerdError with its code."""
    if isinstance(message, wire.Error):
        raise PeerdError(message.code, message.message)
    return message


def check_reply(answer: wire.Message, reply: type[Answer]) -> Answer:
    if not isinstance(answer, reply):
        raise PeerdError(
            wire.ErrorCode.BAD_REPLY, f"expected {reply.__name__}, got {type(answer).__name__}"
        )
    return answer


def token_or_done(message: wire.Message) -> wire.GeneratedToken | wire.GenerateDone:
    if not isinstance(message, wire.GeneratedToken | wire.GenerateDone):
        raise PeerdError(
            wire.ErrorCode.BAD_REPLY, f"expected a token, got {type(message).__name__}"
        )
    return message


def rows_of(prompt: Any) -> int:
    """How many GenerateDone messages end a request for `prompt` (one per row of a batch)."""
    return len(prompt) if isinstance(prompt, list | tuple) else 1


def collect(
    messages: Iterable[wire.GeneratedToken | wire.GenerateDone], rows: int
) -> list[Generation]:
    """Each row's text, token ids and reason from a stream of GeneratedToken / GenerateDone."""
    results = [Generation("", [], "") for _ in range(rows)]
    for message in messages:
        result = results[message.row]
        if isinstance(message, wire.GeneratedToken):
            result.text += message.text
            result.token_ids.append(message.token_id)
        else:
            result.reason = message.reason
    return results
