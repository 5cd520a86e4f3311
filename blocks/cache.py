"""Attention KV caches: a MemoryCache hands out token budget to sessions; a SpanSession holds one
client's keys and values for the layers of one span, preallocated to its max_length."""

from __future__ import annotations

import threading
from types import TracebackType

import torch

from blocks.errors import BlocksError, CacheFull, SessionOverflow


class KVCache:
    """Keys and values of one session for layers first_layer.. of a span (gpt-fast style: one
    buffer per layer of shape [batch, kv_heads, max_length, head_dim], filled up to `length`).

    It offers the one method transformers' attention layers call, `update(key, value, layer_idx)`,
    and returns views of the filled part, so attention never sees unused slots.
    """

    def __init__(self, first_layer: int, num_layers: int, max_length: int) -> None:
        self.first_layer = first_layer
        self.max_length = max_length
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0  # tokens already cached; the layers write their new ones after these

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_idx - self.first_layer
        keys, values = self.keys[i], self.values[i]
        if keys is None or values is None:  # first call: the layer tells us the shape
            batch, heads, _, width = key.shape
            keys = key.new_zeros(batch, heads, self.max_length, width)
            values = value.new_zeros(batch, value.shape[1], self.max_length, value.shape[-1])
            self.keys[i], self.values[i] = keys, values
        return write_step(keys, values, key, value, self.length)

    def nbytes(self) -> int:
        tensors = [t for t in (*self.keys, *self.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def write_step(
    keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor, value: torch.Tensor, at: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one pass's `key` and `value` into a layer's buffers from position `at` on; the
    buffers' filled part, which attention takes (KVCache, and blocks.compiled's graphs)."""
    end = at + key.shape[-2]
    keys[:, :, at:end] = key
    values[:, :, at:end] = value
    return keys[:, :, :end], values[:, :, :end]


class SpanSession:
    """One client's cache on one span: batch_size sequences of up to max_length tokens.

    `position` counts the tokens the span has processed; `rollback(p)` forgets those after p (the
    next forward overwrites them). Use it as a context manager or call close() to free its tokens.
    Span.forward may run in a worker thread, one call at a time per session.
    """

    def __init__(
        self,
        owner: MemoryCache,
        batch_size: int,
        max_length: int,
        left_padding: tuple[int, ...] | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.max_length = max_length
        # Per row: how many of its first positions are padding (prompts of different lengths,
        # left-padded to one); the blocks never attend to them and count positions after them.
        self.left_padding = left_padding or (0,) * batch_size
        self.tokens = batch_size * max_length
        self._owner = owner
        self._kv: KVCache | None = None
        self._span_key: tuple[int, int, int] | None = None
        self._busy = threading.Lock()
        self.closed = False

    @property
    def position(self) -> int:
        return self._kv.length if self._kv is not None else 0

    def rollback(self, position: int) -> None:
        """Go back to `position` tokens, e.g. to regenerate or replay from there."""
        if not 0 <= position <= self.position:
            raise ValueError(
                f"cannot roll back to position {position}: the session holds {self.position} tokens"
            )
        if self._kv is not None:
            self._kv.length = position

    def close(self) -> None:
        """Drop the cached tensors and give the session's tokens back to its MemoryCache."""
        if self.closed:
            return
        self.closed = True
        self._kv = None
        self._owner._release(self)

    def __enter__(self) -> SpanSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"position={self.position}"
        return f"SpanSession(batch_size={self.batch_size}, max_length={self.max_length}, {state})"

    @property
    def padded(self) -> bool:
        return any(self.left_padding)

    def acquire(
        self, span_key: tuple[int, int, int], first_layer: int, num_layers: int, new_tokens: int
    ) -> KVCache:
        """For Span.forward: the KV cache, checked for this span and for room for `new_tokens`.

        The caller must release() it; a second concurrent call fails instead of corrupting it.
        """
        if self.closed:
            raise BlocksError("this session is closed; open a new one")
        if not self._busy.acquire(blocking=False):
            raise BlocksError("this session is already running a forward; call it one at a time")
        try:
            if self._span_key is None:
                self._span_key = span_key
                self._kv = KVCache(first_layer, num_layers, self.max_length)
            elif self._span_key != span_key:
                raise BlocksError("a session caches one span; open another session for this span")
            assert self._kv is not None
            if self._kv.length + new_tokens > self.max_length:
                raise SessionOverflow(
                    f"the session holds {self._kv.length} of its max_length {self.max_length} "
                    f"tokens, so {new_tokens} more do not fit: roll back, or open a session "
                    "with a larger max_length"
                )
            return self._kv
        except BaseException:
            self._busy.release()
            raise

    def release(self) -> None:
        self._busy.release()


def check_left_padding(left_padding: tuple[int, ...], batch_size: int, max_length: int) -> None:
    """ValueError unless there is one padding count per row, each leaving room for a token."""
    if len(left_padding) != batch_size:
        raise ValueError(
            f"left_padding gives {len(left_padding)} rows, the batch has {batch_size}: "
            "give one count of padding positions per row"
        )
    if any(not 0 <= pad < max_length for pad in left_padding):
        raise ValueError(
            f"left_padding {list(left_padding)} must be in 0..{max_length - 1} (max_length "
            f"{max_length}), so every row keeps a position for a token"
        )


class MemoryCache:
    """The attention-cache budget of a server, in tokens: a session of batch_size x max_length
    reserves exactly that many tokens until it closes. Thread-safe."""

    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 0:
            raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
        self.budget_tokens = budget_tokens
        self._used = 0
        self._sessions: set[SpanSession] = set()
        self._lock = threading.Lock()

    @property
    def used_tokens(self) -> int:
        with self._lock:
            return self._used

    @property
    def free_tokens(self) -> int:
        with self._lock:
            return self.budget_tokens - self._used

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def open_session(
        self, batch_size: int, max_length: int, left_padding: tuple[int, ...] | None = None
    ) -> SpanSession:
        """Reserve batch_size * max_length tokens, or raise CacheFull and change nothing.

        `left_padding[r]`: the first positions of row r that are padding, not tokens."""
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1: {batch_size}, {max_length}")
        if left_padding is not None:
            check_left_padding(left_padding, batch_size, max_length)
        session = SpanSession(self, batch_size, max_length, left_padding)
        with self._lock:
            free = self.budget_tokens - self._used
            if session.tokens > free:
                raise CacheFull(
                    f"the attention cache has {free} of {self.budget_tokens} tokens free, and a "
                    f"session of batch {batch_size} x max_length {max_length} needs "
                    f"{session.tokens}: ask for a shorter max_length, wait for sessions to close, "
                    "or give the server a larger cache budget",
                    free_tokens=free,
                    requested_tokens=session.tokens,
                )
            self._used += session.tokens
            self._sessions.add(session)
        return session

    def _release(self, session: SpanSession) -> None:
        with self._lock:
            if session in self._sessions:
                self._sessions.remove(session)
                self._used -= session.tokens
