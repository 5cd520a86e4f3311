"""The errors blocks/ raises: each says what happened and what to do about it."""

from __future__ import annotations


class BlocksError(Exception):
    """Base class of every error raised by blocks/."""


class ModelNotFoundError(BlocksError, FileNotFoundError):
    """A model name or path that does not lead to a usable local checkpoint."""


class UnsupportedModelError(BlocksError):
    """A checkpoint whose `config.model_type` no registered family can run."""


class CheckpointError(BlocksError, ValueError):
    """A checkpoint whose tensors do not fit its own config (a matrix missing or misnamed)."""


class CacheFull(BlocksError):
    """A MemoryCache cannot reserve the tokens a new session asks for.

    `free_tokens` is what the cache could still give; other sessions are untouched.
    """

    def __init__(self, message: str, *, free_tokens: int, requested_tokens: int) -> None:
        super().__init__(message)
        self.free_tokens = free_tokens
        self.requested_tokens = requested_tokens


class SessionOverflow(BlocksError, ValueError):
    """A session asked to hold more tokens than the max_length it was opened with."""
