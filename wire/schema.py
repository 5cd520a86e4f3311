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
    MalformedMessage,
    MalformedTensor,
    ProtocolError,
    UnexpectedMessage,
    UnknownMessageType,
    VersionMismatch,
)
from wire.fields import WireField, compile_fields, spec
from wire.fields import check_items as _check_items
from wire.fields import describe as _describe
from wire.fields import validate as _validate
from wire.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, decode_frame, encode_frame
from wire.tensors import Compression, as_compression, decode_tensor, encode_tensor
from wire.tensors import same_tensor as _same_tensor

PROTOCOL_VERSION = 1
"""The wire protocol this peerd speaks, sent in every frame."""

OLDEST_PROTOCOL_VERSION = 1
"""The oldest version this peerd still accepts (raise it when dropping support)."""

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
    """Base of a message: a record with a wire type tag, sent as one frame."""

    TYPE: ClassVar[str]


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
def message(tag: str) -> Callable[[type[M]], type[M]]:
    """Declare a message with wire type `tag` (snake_case, unique) and register it."""
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


@dataclass(frozen=True)
class _DecodeLimits:
    max_tensor_bytes: int


def _record_from_wire(cls: type[R], body: Any, path: str, limits: _DecodeLimits) -> R:
    if not isinstance(body, dict):
        raise MalformedMessage(f"{path}: must be a map of fields, got {_describe(body)}")
    rec = object.__new__(cls)
    for field in cls._wire_fields:
        field_path = f"{path}.{field.name}"
        if field.name in body:
            value = _validate(
                field, _from_wire(field, body[field.name], field_path, limits), field_path
            )
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
            return decode_tensor(value, max_bytes=limits.max_tensor_bytes)
        except MalformedTensor as error:
            raise MalformedTensor(f"{path}: {error}") from None
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
    """The validated message in `data`: a map from `FrameDecoder.next_frame()`, or the bytes of
    exactly one complete frame.

    `expect` restricts the message types accepted (UnexpectedMessage otherwise). Tensors larger
    than `max_frame_size` bytes are refused (lz4 could otherwise inflate a small frame). Raises
    ProtocolError; VersionMismatch is checked before anything but the envelope being a map.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        obj: Any = decode_frame(data, max_frame_size=max_frame_size)
    else:
        obj = data
    if not isinstance(obj, dict):
        raise MalformedMessage(f"a message frame holds a map, got {_describe(obj)}")
    limits = _DecodeLimits(max_tensor_bytes=max_frame_size)
    if "protocol" not in obj:
        raise MalformedMessage(
            "frame has no 'protocol' field: the peer does not speak the peerd wire protocol"
        )
    version = obj["protocol"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise MalformedMessage(f"frame field protocol must be an integer, got {_describe(version)}")
    if not OLDEST_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        raise VersionMismatch(version, PROTOCOL_VERSION, OLDEST_PROTOCOL_VERSION)
    tag = obj.get("type")
    if not isinstance(tag, str):
        raise MalformedMessage(f"frame field type must be a string, got {_describe(tag)}")
    cls = _MESSAGE_TYPES.get(tag)
    if cls is None:
        raise UnknownMessageType(
            f"unknown message type {tag!r:.80}: this peerd (protocol {PROTOCOL_VERSION}) knows "
            f"{', '.join(sorted(_MESSAGE_TYPES))}"
        )
    if expect is not None:
        allowed = expect if isinstance(expect, tuple) else (expect,)
        if cls not in allowed:
            raise UnexpectedMessage(
                f"got a {tag} message where only {', '.join(c.TYPE for c in allowed)} may come"
            )
    if "body" not in obj:
        raise MalformedMessage(f"{tag}: frame has no body field")
    return _record_from_wire(cls, obj["body"], tag, limits)


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
    end of stream. A ProtocolError ends the stream: later calls raise it again.
    """

    def __init__(
        self, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, expect: Expect = None
    ) -> None:
        self._frames = FrameDecoder(max_frame_size=max_frame_size)
        self._expect = expect
        self._error: ProtocolError | None = None

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Take bytes from the stream; `b""` means the stream ended."""
        self._frames.receive_data(data)

    def next_message(self) -> Message | None:
        """The next complete message, or None until more data arrives. Raises ProtocolError."""
        if self._error is not None:
            raise self._error
        try:
            obj = self._frames.next_frame()
            if obj is None:
                return None
            return decode_message(
                obj, max_frame_size=self._frames.max_frame_size, expect=self._expect
            )
        except ProtocolError as error:
            self._error = error
            raise

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
