"""Typed messages: frozen dataclasses with a wire type tag, every field validated both ways.

A message is declared once, as a dataclass whose annotations and `spec(...)` constraints are the
schema (docs/wire.md#adding-a-message):

    @message("close_session")
    class CloseSession(Message):
        session_id: str = spec(min_len=1, max_len=MAX_ID_LEN)

Annotations understood (wire.fields): int, float, bool, str, bytes, torch.Tensor, Literal["a", "b"]
or a str-valued Enum, a @record class (a nested map), tuple[X, ...] (a list), and `X | None`
(optional: omitted or nil on the wire, must default to None). Constructing a message validates
it (MalformedMessage on a bad field), so a peer never receives what it would refuse; decoding runs
the same checks on the wire values, with the path of the bad field in the error. Unknown keys in a
body are ignored, so a newer peer can add an optional field without breaking older ones; a change
older peers must not ignore bumps PROTOCOL_VERSION.

Envelope of every frame: `{"protocol": PROTOCOL_VERSION, "type": "<tag>", "body": {fields}}`. The
version is checked before anything else in the frame, so peers of different versions fail with
VersionMismatch whatever else changed.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias, TypeVar, dataclass_transform, overload

import torch

from wire.errors import (
    MalformedFrame,
    MalformedMessage,
    MalformedTensor,
    NonFiniteTensor,
    ProtocolError,
    UnexpectedMessage,
    UnknownMessageType,
    VersionMismatch,
    detach_current,
    detached,
)
from wire.fields import WireField, compile_fields, object_bound, spec
from wire.fields import check_items as _check_items
from wire.fields import describe as _describe
from wire.fields import validate as _validate
from wire.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame, single_body
from wire.packing import Reader
from wire.tensors import Compression, as_compression, decode_tensor, encode_tensor
from wire.tensors import same_tensor as _same_tensor

PROTOCOL_VERSION = 1
"""The wire protocol this peerd speaks, sent in every frame."""

OLDEST_PROTOCOL_VERSION = 1
"""The oldest version this peerd still accepts (raise it when dropping support)."""

UNKNOWN_FIELD_OBJECTS = 4096
"""Values a body may hold beyond what its type's schema allows: room for the optional fields a
newer peer adds (older peers ignore them)."""

ENVELOPE_OBJECTS = 64
"""Values an envelope may hold besides its body: the keys, protocol and type, and a few unknown
entries."""

R = TypeVar("R", bound="Record")
M = TypeVar("M", bound="Message")


class Record:
    """Base of a validated map of fields; declare one with @record (or @message for a message)."""

    _wire_fields: ClassVar[tuple[WireField, ...]]

    def __post_init__(self) -> None:
        label = getattr(self, "TYPE", type(self).__name__)
        for field in self._wire_fields:
            value = _validate(field, getattr(self, field.name), f"{label}.{field.name}")
            object.__setattr__(self, field.name, value)
        _run_check(self, label)

    def check(self) -> None:
        """Rules across fields (e.g. end > start): raise ValueError(reason) to refuse the record."""

    def to_dict(self) -> dict[str, Any]:
        """Fields as a plain map (nested records as maps, tuples as lists, tensors as they are)."""
        return {field.name: _plain(getattr(self, field.name)) for field in self._wire_fields}

    @classmethod
    def from_dict(cls: type[R], fields: Mapping[str, Any]) -> R:
        """Build from a map of fields, validated as on the wire; unknown keys are ignored (e.g.
        a routing record's local bookkeeping). Raises MalformedMessage."""
        label = getattr(cls, "TYPE", cls.__name__)
        return _record_from_wire(cls, dict(fields), label, _DecodeLimits(DEFAULT_MAX_FRAME_SIZE))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(
            _equal(getattr(self, field.name), getattr(other, field.name))
            for field in self._wire_fields
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{field.name}={_short_repr(getattr(self, field.name))}" for field in self._wire_fields
        )
        return f"{type(self).__name__}({fields})"


class Message(Record):
    """Base of a message: a record with a wire type tag, sent as one frame.

    MAX_FRAME: the largest frame of this type a decoder accepts (None: the stream's own limit),
    checked before the body is read, and before the frame is even allocated where the receiver
    says which types it expects next. MAX_OBJECTS: values its body may hold (from the schema)."""

    TYPE: ClassVar[str]
    MAX_FRAME: ClassVar[int | None] = None
    MAX_OBJECTS: ClassVar[int]


_MESSAGE_TYPES: dict[str, type[Message]] = {}


@dataclass_transform(
    kw_only_default=True, frozen_default=True, eq_default=False, field_specifiers=(spec,)
)
def record(cls: type[R]) -> type[R]:
    """Declare a nested record (a map inside messages), e.g. ServerInfo."""
    built = dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)(cls)
    built._wire_fields = compile_fields(built, Record)
    return built


@dataclass_transform(
    kw_only_default=True, frozen_default=True, eq_default=False, field_specifiers=(spec,)
)
def message(tag: str, *, max_frame: int | None = None) -> Callable[[type[M]], type[M]]:
    """Declare a message with wire type `tag` (snake_case, unique) and register it; `max_frame`:
    the largest frame of this type a receiver accepts (None: the stream's limit)."""
    if not tag or not tag.replace("_", "").isalnum() or tag != tag.lower():
        raise ValueError(f"message tag {tag!r} must be snake_case")

    def register(cls: type[M]) -> type[M]:
        if tag in _MESSAGE_TYPES:
            raise ValueError(f"message tag {tag!r} is taken by {_MESSAGE_TYPES[tag].__name__}")
        if not issubclass(cls, Message):
            raise TypeError(f"@message class {cls.__name__} must subclass Message")
        cls.TYPE = tag
        built = dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)(cls)
        built._wire_fields = compile_fields(built, Record)
        built.MAX_FRAME = max_frame
        built.MAX_OBJECTS = object_bound(built._wire_fields) + UNKNOWN_FIELD_OBJECTS
        _MESSAGE_TYPES[tag] = built
        return built

    return register


def message_types() -> Mapping[str, type[Message]]:
    """Every registered message class by wire tag (read-only)."""
    return types.MappingProxyType(_MESSAGE_TYPES)


def _run_check(rec: Record, path: str) -> None:
    try:
        rec.check()
    except ValueError as error:
        raise MalformedMessage(f"{path}: {error}") from None


# --- to and from wire values -------------------------------------------------------------------


def _record_to_wire(rec: Record, compression: Compression) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for field in rec._wire_fields:
        value = getattr(rec, field.name)
        if value is not None:
            body[field.name] = _to_wire(field, value, compression)
    return body


def _to_wire(field: WireField, value: Any, compression: Compression) -> Any:
    if field.kind == "tensor":
        return encode_tensor(value, compression)
    if field.kind == "record":
        return _record_to_wire(value, compression)
    if field.kind == "tuple":
        assert field.item is not None
        item = field.item
        return [_to_wire(item, element, compression) for element in value]
    if field.choice_type is not None:
        return value.value  # the plain string, not the Enum
    return value


@dataclass
class _DecodeLimits:
    """What the tensors of one message may still decode to, all together: lz4 must not let a
    small frame of several tensors ask for more memory than the frame limit allows one frame."""

    tensor_bytes_left: int


def _record_from_wire(cls: type[R], body: Any, path: str, limits: _DecodeLimits) -> R:
    if not isinstance(body, dict):
        raise MalformedMessage(f"{path}: must be a map of fields, got {_describe(body)}")
    rec = object.__new__(cls)
    for field in cls._wire_fields:
        field_path = f"{path}.{field.name}"
        if field.name in body:
            value = _from_wire(field, body[field.name], field_path, limits)
            try:
                value = _validate(field, value, field_path)
            except NonFiniteTensor as error:
                raise MalformedTensor(str(error)) from None
        elif field.make_default is not None:
            value = field.make_default()
        else:
            raise MalformedMessage(f"{field_path}: required field is missing")
        object.__setattr__(rec, field.name, value)
    _run_check(rec, path)
    return rec


def _from_wire(field: WireField, value: Any, path: str, limits: _DecodeLimits) -> Any:
    if value is None:
        return None
    if field.kind == "tensor":
        if isinstance(value, torch.Tensor):  # from_dict on Python values
            return value
        try:
            tensor = decode_tensor(value, max_bytes=limits.tensor_bytes_left)
        except MalformedTensor as error:
            raise MalformedTensor(f"{path}: {error}") from None
        limits.tensor_bytes_left -= tensor.nbytes
        return tensor
    if field.kind == "record":
        assert field.record is not None
        if isinstance(value, field.record):  # from_dict on Python values
            return value
        return _record_from_wire(field.record, value, path, limits)
    if field.kind == "tuple":
        assert field.item is not None
        if not isinstance(value, list | tuple):
            raise MalformedMessage(f"{path}: must be a list, got {_describe(value)}")
        _check_items(len(value), field.rule, path)  # before converting a single item
        item = field.item
        if item.kind not in ("tensor", "record"):
            return value
        return [
            _from_wire(item, element, f"{path}[{index}]", limits)
            for index, element in enumerate(value)
        ]
    return value


# --- envelopes and frames -----------------------------------------------------------------------


def to_envelope(msg: Message, compression: Compression | str = "raw") -> dict[str, Any]:
    """The frame map for `msg`: {"protocol", "type", "body"}; tensors encoded with `compression`."""
    if not isinstance(msg, Message):
        raise TypeError(f"expected a Message, got {type(msg).__name__}")
    return {
        "protocol": PROTOCOL_VERSION,
        "type": msg.TYPE,
        "body": _record_to_wire(msg, as_compression(compression)),
    }


Expect: TypeAlias = type[Message] | tuple[type[Message], ...] | None
Incoming: TypeAlias = dict[str, Any] | bytes | bytearray | memoryview


@overload
def decode_message(data: Incoming, *, max_frame_size: int = ..., expect: type[M]) -> M: ...
@overload
def decode_message(
    data: Incoming,
    *,
    max_frame_size: int = ...,
    expect: tuple[type[Message], ...] | None = None,
) -> Message: ...
def decode_message(
    data: Incoming,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    expect: Expect = None,
) -> Message:
    """The validated message in `data`: the bytes of exactly one complete frame, or an envelope
    map already decoded (e.g. by `FrameDecoder.next_frame()`).

    `expect` restricts the message types accepted (UnexpectedMessage otherwise). The tensors of
    one message decode to at most `max_frame_size` bytes in all (lz4 could otherwise inflate a
    small frame). Raises ProtocolError; VersionMismatch is checked before anything but the
    envelope being a map.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        return decode_body(single_body(data, max_frame_size), max_frame_size, expect)
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
    return _record_from_wire(cls, data["body"], cls.TYPE, _DecodeLimits(max_frame_size))


def decode_body(frame_body: memoryview, max_frame_size: int, expect: Expect = None) -> Message:
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
    return decode_message(envelope, max_frame_size=max_frame_size, expect=expect)


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


def encode_message(
    msg: Message,
    compression: Compression | str = "raw",
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
) -> memoryview:
    """One frame (read-only bytes-like) carrying `msg`, its tensors encoded with `compression`.

    Raises FrameTooLarge if the frame would be over `max_frame_size` (the peer would refuse it).
    """
    return encode_frame(to_envelope(msg, compression), max_frame_size=max_frame_size)


class MessageDecoder:
    """Incremental message decoder: bytes in (any chunking), validated messages out.

    `receive_data(chunk)` then `next_message()` until None (or iterate); `receive_data(b"")` at
    end of stream. A ProtocolError ends the stream: later calls raise it again (a copy without
    its traceback, so a failed decode keeps nothing of what it decoded alive).
    """

    def __init__(
        self, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, expect: Expect = None
    ) -> None:
        self._frames = FrameDecoder(max_frame_size=max_frame_size)
        self._expect = expect
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
        return decode_body(body, self._frames.max_frame_size, self._next_expect)

    def __iter__(self) -> Iterator[Message]:
        while (msg := self.next_message()) is not None:
            yield msg

    @property
    def ended(self) -> bool:
        return self._frames.ended


# --- helpers ------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _short_repr(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({str(value.dtype).removeprefix('torch.')}, {list(value.shape)})"
    if isinstance(value, tuple) and len(value) > 8:
        return f"({', '.join(_short_repr(v) for v in value[:8])}, ... {len(value)} items)"
    if isinstance(value, tuple):
        return f"({', '.join(_short_repr(v) for v in value)}{',' if len(value) == 1 else ''})"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
