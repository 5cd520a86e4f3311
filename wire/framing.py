"""Length-prefixed frames: `encode_frame(map) -> bytes` and an incremental `FrameDecoder`.

A frame is a 4-byte big-endian body length followed by that many bytes of msgpack holding one map
(docs/wire.md#frames). The decoder is sans-IO in the h11 manner: feed it whatever bytes arrived,
in any chunking, with `receive_data`, then take complete frames with `next_frame` until it returns
None; `receive_data(b"")` says the stream ended. The length is checked against the limit as soon
as its 4 bytes are in, before any buffer for the body exists.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterator
from typing import Any

from wire.buffers import allocate, copy_bytes, freeze, is_immutable
from wire.errors import FrameTooLarge, MalformedFrame, ProtocolError, detach_current, detached
from wire.packing import MAX_OBJECTS, byte_view, pack_parts, unpack

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size

DEFAULT_MAX_FRAME_SIZE = 256 << 20
"""Largest frame body accepted by default (256 MiB). The biggest peerd message is a Backward
carrying two fp32 tensors for a full 8192-token prefill at hidden size 4096 (128 MiB each);
anything larger should be split into several steps by its sender. Each side may configure its own
limit; memory a peer can make us commit is bounded by it."""

SMALL_FRAME = 1 << 20
"""Frames below this are assembled in ordinary bytes objects; larger ones in numpy buffers, which
the kernel backs with huge pages (half the cost of first-touching 4 KiB pages at these sizes)."""


def encode_frame(
    obj: dict[str, Any], *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> memoryview:
    """One frame carrying the map `obj`, as a read-only bytes-like memoryview.

    Pass it to a stream's write/send_all as is, or `bytes(frame)` for a bytes object. Raises
    FrameTooLarge if the body is over `max_frame_size` (the peer would refuse it), TypeError or
    ValueError for a value msgpack cannot carry.
    """
    if not isinstance(obj, dict):
        raise TypeError(f"a frame carries a map, got {type(obj).__name__}")
    parts = pack_parts(obj)
    size = sum(len(part) for part in parts)
    if size > max_frame_size:
        raise FrameTooLarge(size, max_frame_size, sending=True)
    if size < SMALL_FRAME:
        return memoryview(b"".join([HEADER.pack(size), *parts]))
    out = allocate(HEADER_SIZE + size)
    HEADER.pack_into(out, 0, size)
    pos = HEADER_SIZE
    for part in parts:
        copy_bytes(out[pos : pos + len(part)], byte_view(part))
        pos += len(part)
    return freeze(out)


def decode_frame(
    frame: bytes | bytearray | memoryview, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> dict[str, Any]:
    """The map in `frame`, which must be exactly one complete frame. Raises ProtocolError."""
    return _map_of(single_body(frame, max_frame_size), MAX_OBJECTS)


def single_body(frame: bytes | bytearray | memoryview, max_frame_size: int) -> memoryview:
    """The body of `frame`, which must be exactly one complete frame. Raises ProtocolError."""
    decoder = FrameDecoder(max_frame_size=max_frame_size)
    decoder.receive_data(frame)
    decoder.receive_data(b"")
    body = decoder.next_body()
    if body is None:
        raise MalformedFrame("expected one frame, got an empty stream")
    if decoder.next_body() is not None:
        raise MalformedFrame("expected one frame, got several")
    return body


def _map_of(body: memoryview, max_objects: int) -> dict[str, Any]:
    obj = unpack(body, max_objects=max_objects)
    if not isinstance(obj, dict):
        raise MalformedFrame(
            f"a frame carries a msgpack map, this one carries a {type(obj).__name__}"
        )
    return obj


class FrameDecoder:
    """Incremental frame decoder: bytes in (any chunking), msgpack maps out.

    After a ProtocolError the stream is unusable (its framing can no longer be trusted): every later
    `next_frame` raises the same error, after the frames completed before it.
    """

    def __init__(self, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if not 0 < max_frame_size < 1 << 32:
            raise ValueError("max_frame_size must be between 1 and 2**32 - 1 bytes")
        self.max_frame_size = max_frame_size
        self.frame_limit = max_frame_size
        """Largest body accepted for frames whose length arrives from now on (at most
        max_frame_size; a message decoder lowers it when it knows which types may come)."""
        self._header = bytearray()
        self._body: memoryview | None = None  # the frame being filled, allocated at its full size
        self._filled = 0
        self._complete: deque[memoryview] = deque()
        self._error: ProtocolError | None = None
        self._ended = False

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Take bytes from the stream; `b""` means the stream ended (no more data may follow).

        Bytes are copied into buffers the decoder owns, so the caller may reuse `data`; except
        that whole frames inside an immutable `data` (a bytes object, or a frame from
        `encode_frame`) are kept as views of it, without a copy.
        """
        view = byte_view(data)
        if self._ended and view:
            raise RuntimeError("receive_data called with data after the end of the stream (b'')")
        if not view:
            self._ended = True
            return
        immutable = is_immutable(view)
        pos = 0
        while pos < len(view) and self._error is None:
            at_boundary = self._body is None and not self._header
            if at_boundary and immutable and len(view) - pos >= HEADER_SIZE:
                size = HEADER.unpack_from(view, pos)[0]
                if 0 < size <= self._limit and size <= len(view) - pos - HEADER_SIZE:
                    self._complete.append(view[pos + HEADER_SIZE : pos + HEADER_SIZE + size])
                    pos += HEADER_SIZE + size
                    continue
            if self._body is None:
                take = min(HEADER_SIZE - len(self._header), len(view) - pos)
                self._header += view[pos : pos + take]
                pos += take
                if len(self._header) == HEADER_SIZE:
                    self._start_body(HEADER.unpack(self._header)[0])
                    self._header.clear()
            else:
                take = min(len(self._body) - self._filled, len(view) - pos)
                copy_bytes(self._body[self._filled : self._filled + take], view[pos : pos + take])
                self._filled += take
                pos += take
                if self._filled == len(self._body):
                    self._complete.append(self._body)
                    self._body = None

    @property
    def _limit(self) -> int:
        return min(self.frame_limit, self.max_frame_size)

    def _start_body(self, size: int) -> None:
        if size > self._limit:
            self._error = FrameTooLarge(size, self._limit)
        elif size == 0:
            self._error = MalformedFrame("frame of length 0: every frame carries one msgpack map")
        else:
            # Allocated only now, after the length passed the limit. A large buffer's pages are
            # untouched until data arrives, so a peer that announces a big frame and stalls costs
            # address space, not memory.
            self._body = memoryview(bytearray(size)) if size < SMALL_FRAME else allocate(size)
            self._filled = 0

    def next_frame(self, *, max_objects: int = MAX_OBJECTS) -> dict[str, Any] | None:
        """The next complete frame's map, or None until more data arrives. Raises ProtocolError;
        MalformedFrame if the map holds more than `max_objects` values."""
        body = self.next_body()
        if body is None:
            return None
        try:
            return _map_of(body, max_objects)
        except ProtocolError:
            self._fail(detach_current())
            raise

    def next_body(self) -> memoryview | None:
        """The next complete frame's body, not decoded, or None until more data arrives (for a
        decoder that reads it piece by piece). Raises ProtocolError."""
        if self._complete:
            body = self._complete.popleft()
            if len(body) > self._limit:  # its length came in before the limit was lowered
                error = FrameTooLarge(len(body), self._limit)
                self._fail(error)
                raise error
            return body
        if self._error is not None:
            raise detached(self._error)
        if self._ended and (self._header or self._body is not None):
            got = len(self._header) if self._body is None else HEADER_SIZE + self._filled
            need = HEADER_SIZE if self._body is None else HEADER_SIZE + len(self._body)
            truncated = MalformedFrame(
                f"stream ended inside a frame: got {got} of its {need} bytes (peer closed early "
                "or the connection dropped)"
            )
            self._fail(truncated)
            raise truncated
        return None

    def _fail(self, error: ProtocolError) -> None:
        self._error = detached(error)
        self._complete.clear()
        self._body = None
        self._header.clear()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every complete frame available now."""
        while (obj := self.next_frame()) is not None:
            yield obj

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as frames (for flow-control decisions)."""
        pending = sum(HEADER_SIZE + len(body) for body in self._complete)
        partial = len(self._header) if self._body is None else HEADER_SIZE + self._filled
        return pending + partial

    @property
    def ended(self) -> bool:
        """True once `receive_data(b"")` was called."""
        return self._ended
