"""What a local API connection keeps between its requests: the inference sessions it opened, with
the chat turns their servers' caches hold, and the refusal a request ends with (ApiError).

`turn_ids` is the chat-turn bookkeeping: which token ids a new request must feed, given what a
session's caches hold already (rolling the caches back where the chat template renders the last
answer differently from how it was sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import wire
from peerd.session.inference import InferenceSession


class ApiError(Exception):
    """A request we refuse; becomes an Error reply with this code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ApiSession:
    """An inference session a client opened, with what it fed so far (for chat turns)."""

    inference: InferenceSession
    fed: list[int] = field(default_factory=list)  # token ids the servers' caches hold
    pending: list[int] = field(default_factory=list)  # sampled but not yet run through blocks
    messages: list[dict[str, str]] = field(default_factory=list)  # the chat so far


def turn_ids(tokenizer: Any, request: wire.Generate, session: ApiSession | None) -> list[int]:
    """The token ids to feed for this request: the whole prompt without a session; with one,
    only what the servers' caches do not hold yet."""
    if request.input_ids is not None:
        ids = list(request.input_ids)
        return (session.pending + ids) if session else ids
    assert request.prompt is not None
    if not request.chat:
        ids = tokenizer(request.prompt, add_special_tokens=session is None)["input_ids"]
        return (session.pending + list(ids)) if session else list(ids)
    turn = {"role": "user", "content": request.prompt}
    messages = [*(session.messages if session else []), turn]
    full = list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    if session is None:
        return full
    session.messages.append(turn)
    return _past_held(session, full)


def _past_held(session: ApiSession, full: list[int]) -> list[int]:
    """The tail of the templated chat `full` that the session's caches do not hold, rolling them
    back to where the two agree."""
    held = session.fed
    common = 0
    while common < min(len(held), len(full)) and held[common] == full[common]:
        common += 1
    if common < len(held):
        # The template renders the last answer differently from how it was sampled (e.g.
        # an end-of-turn token): roll the servers' caches back to where they agree.
        session.inference.rollback(common)
        session.fed = held[:common]
    session.pending = []
    return full[common:]
