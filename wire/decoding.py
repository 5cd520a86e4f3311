"""Messages out of frames: the envelope read key by key, so a message is refused by its type and
its type's limits before its body is read, and `MessageDecoder`, the incremental decoder a stream
feeds (docs/wire.md#envelope).

A receiver gives each frame the budget its expected types allow: its length against their
MAX_FRAME (when the types to come are known, before the frame is even allocated), the body's
values against its type's MAX_OBJECTS, all tensors of one message together against the frame
limit, and each tensor's shape against the receiver's own rule (`check_tensor`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeAlias, overload

from wire.errors import (
    MalformedFrame,
    MalformedMessage,
    ProtocolError,
    UnexpectedMessage,
    UnknownMessageType,
    VersionMismatch,
    detach_current,
    detached,
)
from wire.fields import describe as _describe
from wire.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, single_body
from wire.packing import Reader
from wire.schema import (
    _MESSAGE_TYPES,
    OLDEST_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    M,
    Message,
    _DecodeLimits,
    _record_from_wire,
)

ENVELOPE_OBJECTS = 64
"""Values an envelope may hold besides its body: the keys, protocol and type, and a few unknown
entries."""


Expect: TypeAlias = type[Message] | tuple[type[Message], ...] | None
TensorCheck: TypeAlias = Callable[[str, list[int]], None]
"""A receiver's rule on the shape of each tensor it decodes, given the field's path (e.g.
`step.hidden_states`) and the shape: raises ValueError(reason) to refuse it before its data is
copied or decompressed (a server checks its hidden size and token limits)."""
Incoming: TypeAlias = dict[str, Any] | bytes | bytearray | memoryview


@overload
def decode_message(
    data: Incoming,
    *,
    max_frame_size: int = ...,
    expect: type[M],
    check_tensor: TensorCheck | None = None,
) -> M: ...
@overload
def decode_message(
    data: Incoming,
    *,
    max_frame_size: int = ...,
    expect: tuple[type[Message], ...] | None = None,
    check_tensor: TensorCheck | None = None,
) -> Message: ...
def decode_message(
    data: Incoming,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    expect: Expect = None,
    check_tensor: TensorCheck | None = None,
) -> Message:
    """The validated message in `data`: the bytes of exactly one complete frame, or an envelope
    map already decoded (e.g. by `FrameDecoder.next_frame()`).

    `expect` restricts the message types accepted (UnexpectedMessage otherwise). The tensors of
    one message decode to at most `max_frame_size` bytes in all (lz4 could otherwise inflate a
    small frame), and each tensor's shape passes `check_tensor` before its data is read. Raises
    ProtocolError; VersionMismatch is checked before anything but the envelope being a map.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        body = single_body(data, max_frame_size)
        return decode_body(body, max_frame_size, expect, check_tensor)
    if not isinstance(data, dict):
        raise MalformedMessage(f"a message frame holds a map, got {_describe(data)}")
    if "protocol" not in data:
        raise MalformedMessage(
            "frame has no 'protocol' field: the peer does not speak the peerd wire protocol"
        )
    _check_version(data["protocol"])
    cls = _message_class(data.get("type"), expect)
    if "body" not in data:
        raise MalformedMessage(f"{cls.TYPE}: frame has no body field")
    limits = _DecodeLimits(max_frame_size, check_tensor)
    return _record_from_wire(cls, data["body"], cls.TYPE, limits)


def decode_body(
    frame_body: memoryview,
    max_frame_size: int,
    expect: Expect = None,
    check_tensor: TensorCheck | None = None,
) -> Message:
    """The message in one frame body (without its length header), read so that nothing is
    built before it is known to be wanted: the envelope's protocol and type must come before
    its body (as every encoder writes them), the type is checked against `expect` and its own
    MAX_FRAME before the body is read, and the body is read within its type's MAX_OBJECTS."""
    reader = Reader(frame_body, max_objects=ENVELOPE_OBJECTS)
    count = reader.map_header()
    if count < 0:
        raise MalformedFrame("a frame carries a msgpack map (the envelope); this one does not")
    envelope: dict[str, Any] = {}
    cls: type[Message] | None = None
    for _ in range(count):
        key = reader.value(1)
        if type(key) is not str or key in envelope:
            raise MalformedFrame(f"envelope key {key!r:.60} is not a string, or comes twice")
        if key != "body":
            envelope[key] = reader.value(1)
            if key == "protocol":
                _check_version(envelope[key])
            continue
        if "protocol" not in envelope or "type" not in envelope:
            raise MalformedMessage(
                "envelope: body comes before protocol and type (encoders write protocol, type, "
                "body in that order, so a receiver knows what it reads before reading it)"
            )
        cls = _message_class(envelope["type"], expect)
        if cls.MAX_FRAME is not None and len(frame_body) > cls.MAX_FRAME:
            raise MalformedMessage(
                f"{cls.TYPE}: frame of {len(frame_body)} bytes is over the {cls.MAX_FRAME}-byte "
                "limit of this message type"
            )
        reader.budget = cls.MAX_OBJECTS
        envelope[key] = reader.value(1)
        reader.budget = ENVELOPE_OBJECTS
    reader.finish()
    return decode_message(
        envelope, max_frame_size=max_frame_size, expect=expect, check_tensor=check_tensor
    )


def _check_version(version: object) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise MalformedMessage(f"frame field protocol must be an integer, got {_describe(version)}")
    if not OLDEST_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        raise VersionMismatch(version, PROTOCOL_VERSION, OLDEST_PROTOCOL_VERSION)


def _message_class(tag: object, expect: Expect) -> type[Message]:
    if not isinstance(tag, str):
        raise MalformedMessage(f"frame field type must be a string, got {_describe(tag)}")
    cls = _MESSAGE_TYPES.get(tag)
    if cls is None:
        raise UnknownMessageType(
            f"unknown message type {tag!r:.80}: this peerd (protocol {PROTOCOL_VERSION}) knows "
            f"{', '.join(sorted(_MESSAGE_TYPES))}"
        )
    allowed = _allowed(expect)
    if allowed is not None and cls not in allowed:
        raise UnexpectedMessage(
            f"got a {tag} message where only {', '.join(c.TYPE for c in allowed)} may come"
        )
    return cls


def _allowed(expect: Expect) -> tuple[type[Message], ...] | None:
    if expect is None:
        return None
    return expect if isinstance(expect, tuple) else (expect,)


def frame_limit(expect: Expect, max_frame_size: int) -> int:
    """The largest frame worth reading when only `expect` may come next."""
    allowed = _allowed(expect)
    if allowed is None or any(cls.MAX_FRAME is None for cls in allowed):
        return max_frame_size
    return min(max_frame_size, max(cls.MAX_FRAME or 0 for cls in allowed))


class MessageDecoder:
    """Incremental message decoder: bytes in (any chunking), validated messages out.

    `receive_data(chunk)` then `next_message()` until None (or iterate); `receive_data(b"")` at
    end of stream. A ProtocolError ends the stream: later calls raise it again (a copy without
    its traceback, so a failed decode keeps nothing of what it decoded alive).
    """

    def __init__(
        self,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        expect: Expect = None,
        check_tensor: TensorCheck | None = None,
    ) -> None:
        self._frames = FrameDecoder(max_frame_size=max_frame_size)
        self._expect = expect
        self.check_tensor = check_tensor
        """The receiver's rule on tensor shapes (decode_message's check_tensor); may be set
        between messages."""
        self._error: ProtocolError | None = None
        self.expect_next(expect)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Take bytes from the stream; `b""` means the stream ended."""
        self._frames.receive_data(data)

    def expect_next(self, expect: Expect) -> None:
        """Accept only `expect` (None: what the decoder was made with) from the next message
        on: frames too large for every type in it are refused as soon as their length is in."""
        expect = self._expect if expect is None else expect
        self._next_expect = expect
        self._frames.frame_limit = frame_limit(expect, self._frames.max_frame_size)

    def next_message(self) -> Message | None:
        """The next complete message, or None until more data arrives. Raises ProtocolError."""
        if self._error is not None:
            raise detached(self._error)
        try:
            return self._decode_next()
        except ProtocolError:
            self._error = detach_current()
            raise

    def _decode_next(self) -> Message | None:
        body = self._frames.next_body()
        if body is None:
            return None
        return decode_body(body, self._frames.max_frame_size, self._next_expect, self.check_tensor)

    def __iter__(self) -> Iterator[Message]:
        while (msg := self.next_message()) is not None:
            yield msg

    @property
    def ended(self) -> bool:
        return self._frames.ended
