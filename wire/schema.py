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
VersionMismatch whatever else changed. Reading messages out of frames is wire.decoding.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, dataclass_transform

import torch

from wire.errors import (
    MalformedMessage,
    MalformedTensor,
    NonFiniteTensor,
)
from wire.fields import WireField, compile_fields, object_bound, spec
from wire.fields import check_items as _check_items
from wire.fields import describe as _describe
from wire.fields import validate as _validate
from wire.framing import DEFAULT_MAX_FRAME_SIZE, encode_frame
from wire.tensors import Compression, as_compression, decode_tensor, encode_tensor
from wire.tensors import same_tensor as _same_tensor

PROTOCOL_VERSION = 1
"""The wire protocol this peerd speaks, sent in every frame."""

OLDEST_PROTOCOL_VERSION = 1
"""The oldest version this peerd still accepts (raise it when dropping support)."""

UNKNOWN_FIELD_OBJECTS = 4096
"""Values a body may hold beyond what its type's schema allows: room for the optional fields a
newer peer adds (older peers ignore them)."""

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
    check_tensor: Callable[[str, list[int]], None] | None = None  # decoding.TensorCheck


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
            check = limits.check_tensor
            tensor = decode_tensor(
                value,
                max_bytes=limits.tensor_bytes_left,
                check_shape=None if check is None else functools.partial(check, path),
            )
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
