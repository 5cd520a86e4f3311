"""Fields of wire records: the `spec(...)` constraints a field declares, the compiled form of an
annotated field, and the check of a Python value against it (shared by construction and decoding).

wire.schema builds records and messages out of these; a field's kinds are int, float, bool, str,
bytes, tensor, literal (Literal["a", "b"] or a str-valued Enum), record (a nested @record) and
tuple (a list of one kind).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any, Literal

import numpy as np
import torch

from wire.errors import MalformedMessage, NonFiniteTensor
from wire.tensors import DTYPES

DEFAULT_MAX_STR_LEN = 256
"""Characters a str field may hold unless its spec says otherwise: ids, names and addresses."""

DEFAULT_MAX_ITEMS = 64
"""Items a tuple field may hold unless its spec says otherwise."""

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class Rule:
    """The constraints of one field, as spec() declared them."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    min_len: int | None = None
    max_len: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    ndim: int | None = None
    floating: bool = False
    allow_nonfinite: bool = False
    allow_empty: bool = False


def spec(
    *,
    default: Any = MISSING,
    default_factory: Callable[[], Any] | Any = MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    min_len: int | None = None,
    max_len: int | None = None,
    min_items: int | None = None,
    max_items: int | None = None,
    ndim: int | None = None,
    floating: bool = False,
    allow_nonfinite: bool = False,
    allow_empty: bool = False,
) -> Any:
    """Constraints on one field (a dataclass field specifier).

    ge/gt/le/lt: bounds of an int or float (of each item, for a tuple). min_len/max_len: characters
    of a str, bytes of a bytes field. min_items/max_items: length of a tuple. ndim/floating: a
    tensor's dimensions and dtype class. allow_nonfinite: accept inf/nan in a float field or a
    floating tensor. allow_empty: accept a tensor with a dimension of size 0.
    """
    rule = Rule(
        ge,
        gt,
        le,
        lt,
        min_len,
        max_len,
        min_items,
        max_items,
        ndim,
        floating,
        allow_nonfinite,
        allow_empty,
    )
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={"wire": rule}
    )


@dataclass(frozen=True)
class WireField:
    """One field of a record, compiled from its annotation and spec."""

    name: str
    kind: str  # int float bool str bytes tensor literal record tuple
    optional: bool
    rule: Rule
    make_default: Callable[[], Any] | None = None  # None: the field is required
    choices: tuple[str, ...] = ()
    choice_type: type[enum.Enum] | None = None  # a literal field's Enum, which values become
    record: type | None = None  # a record field's @record class
    item: WireField | None = None


_SCALARS: dict[Any, str] = {
    int: "int",
    float: "float",
    bool: "bool",
    str: "str",
    bytes: "bytes",
    torch.Tensor: "tensor",
}


def compile_fields(cls: type, record_base: type) -> tuple[WireField, ...]:
    """The fields of dataclass `cls`, compiled from its annotations and spec() constraints;
    an annotation that subclasses `record_base` is a nested record."""
    hints = typing.get_type_hints(cls)
    compiled = []
    for field in dataclasses.fields(cls):
        rule = field.metadata.get("wire", Rule())
        compiled_field = _compile_type(field.name, hints[field.name], rule, cls, record_base)
        if field.default is not MISSING:
            compiled_field = dataclasses.replace(
                compiled_field, make_default=functools.partial(_constant, field.default)
            )
        elif field.default_factory is not MISSING:
            compiled_field = dataclasses.replace(compiled_field, make_default=field.default_factory)
        if compiled_field.optional and field.default is not None:
            raise TypeError(f"{cls.__name__}.{field.name}: an optional field must default to None")
        compiled.append(compiled_field)
    return tuple(compiled)


def _constant(value: Any) -> Any:
    return value


def _compile_type(
    name: str, annotation: Any, rule: Rule, owner: type, record_base: type
) -> WireField:
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) != 1 or len(typing.get_args(annotation)) != 2:
            raise TypeError(f"{owner.__name__}.{name}: only `X | None` unions are supported")
        optional = True
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if annotation in _SCALARS:
        return WireField(name, _SCALARS[annotation], optional, rule)
    if origin is Literal:
        return _literal(name, typing.get_args(annotation), optional, rule, owner)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = tuple(member.value for member in annotation)
        literal = _literal(name, choices, optional, rule, owner)
        return dataclasses.replace(literal, choice_type=annotation)
    if origin is tuple:
        item_args = typing.get_args(annotation)
        if len(item_args) != 2 or item_args[1] is not Ellipsis:
            raise TypeError(f"{owner.__name__}.{name}: use tuple[X, ...] for a list field")
        item = _compile_type(f"{name}[]", item_args[0], rule, owner, record_base)
        if item.optional or item.kind == "tuple":
            raise TypeError(f"{owner.__name__}.{name}: items may not be optional or tuples")
        return WireField(name, "tuple", optional, rule, item=item)
    if isinstance(annotation, type) and issubclass(annotation, record_base):
        if not hasattr(annotation, "_wire_fields"):
            raise TypeError(f"{owner.__name__}.{name}: {annotation.__name__} is not a @record")
        return WireField(name, "record", optional, rule, record=annotation)
    raise TypeError(f"{owner.__name__}.{name}: no wire encoding for {annotation!r}")


def _literal(
    name: str, choices: tuple[Any, ...], optional: bool, rule: Rule, owner: type
) -> WireField:
    if not all(isinstance(choice, str) for choice in choices):
        raise TypeError(f"{owner.__name__}.{name}: Literal and Enum choices must be str")
    return WireField(name, "literal", optional, rule, choices=choices)


# --- checking a value against its field ----------------------------------------------------------


def validate(field: WireField, value: Any, path: str) -> Any:
    """Check a Python value against its field; return it normalised (tuple for list, etc.)."""
    if value is None:
        if field.optional:
            return None
        raise MalformedMessage(f"{path}: required, got nothing")
    return _VALIDATORS[field.kind](field, value, path)


def _int(field: WireField, value: Any, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedMessage(f"{path}: must be an integer, got {describe(value)}")
    rule = field.rule
    low = _INT64_MIN if rule.ge is None and rule.gt is None else None
    high = _INT64_MAX if rule.le is None and rule.lt is None else None
    _check_range(int(value), rule, path, low, high)
    return int(value)


def _float(field: WireField, value: Any, path: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise MalformedMessage(f"{path}: must be a number, got {describe(value)}")
    number = float(value)
    if not field.rule.allow_nonfinite and not math.isfinite(number):
        raise MalformedMessage(f"{path}: must be a finite number, got {number}")
    _check_range(number, field.rule, path, None, None)
    return number


def _bool(field: WireField, value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise MalformedMessage(f"{path}: must be true or false, got {describe(value)}")
    return value


def _str(field: WireField, value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise MalformedMessage(f"{path}: must be a string, got {describe(value)}")
    _check_length(len(value), field.rule, path, "characters", DEFAULT_MAX_STR_LEN)
    return str(value)


def _bytes(field: WireField, value: Any, path: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise MalformedMessage(f"{path}: must be binary, got {describe(value)}")
    data = bytes(value)
    _check_length(len(data), field.rule, path, "bytes", None)
    return data


def _choice(field: WireField, value: Any, path: str) -> Any:
    if not isinstance(value, str) or value not in field.choices:
        raise MalformedMessage(
            f"{path}: must be one of {', '.join(field.choices)}; got {describe(value)}"
        )
    if field.choice_type is not None:
        return field.choice_type(value)
    return str(value)


def _tensor(field: WireField, value: Any, path: str) -> torch.Tensor:
    rule = field.rule
    if not isinstance(value, torch.Tensor):
        raise MalformedMessage(f"{path}: must be a tensor, got {describe(value)}")
    if value.dtype not in DTYPES.values():
        raise MalformedMessage(f"{path}: dtype {value.dtype} has no wire encoding")
    if rule.ndim is not None and value.dim() != rule.ndim:
        raise MalformedMessage(
            f"{path}: must have {rule.ndim} dimensions, got shape {list(value.shape)}"
        )
    if rule.floating and not value.is_floating_point():
        raise MalformedMessage(f"{path}: must be a floating tensor, got {value.dtype}")
    if not rule.allow_empty and 0 in value.shape:
        raise MalformedMessage(
            f"{path}: has shape {list(value.shape)}, with no values: every dimension must be at "
            "least 1 (a step or pass carries at least one token of one sequence)"
        )
    if not rule.allow_nonfinite and value.is_floating_point() and not all_finite(value):
        raise NonFiniteTensor(
            f"{path}: holds nan or inf values: peers exchange finite values only (the sender's "
            "computation overflowed or diverged: check its inputs and dtype)"
        )
    return value


# Dtypes numpy checks in place: its isfinite over a CPU tensor's memory took 2.7 us for a decode
# step's [4, 1, 576] against 11.7 us for torch's isfinite + all, and 42 against 622 us for a
# [8, 100, 576] prefill (one thread); every message with hidden states is checked once on each
# side, on the event loop.
_NUMPY_FLOATS = (torch.float32, torch.float16, torch.float64)


def all_finite(tensor: torch.Tensor) -> bool:
    """No nan or inf in `tensor` (a bool array of numel bytes is the only allocation)."""
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS and not tensor.requires_grad:
        try:
            return bool(np.isfinite(tensor.numpy()).all())
        except (RuntimeError, TypeError):  # a view numpy cannot share (a lazy negation or conj)
            pass
    return bool(torch.isfinite(tensor).all())


def _record(field: WireField, value: Any, path: str) -> Any:
    assert field.record is not None
    if not isinstance(value, field.record):
        raise MalformedMessage(f"{path}: must be a {field.record.__name__}, got {describe(value)}")
    return value


def _tuple(field: WireField, value: Any, path: str) -> tuple[Any, ...]:
    assert field.item is not None
    if not isinstance(value, list | tuple):
        raise MalformedMessage(f"{path}: must be a list, got {describe(value)}")
    check_items(len(value), field.rule, path)
    item = field.item
    try:
        return tuple(validate(item, element, path) for element in value)
    except MalformedMessage:
        # Paths are built only on failure: a list may hold 100k token ids.
        for index, element in enumerate(value):
            validate(item, element, f"{path}[{index}]")
        raise


_VALIDATORS: dict[str, Callable[[WireField, Any, str], Any]] = {
    "int": _int,
    "float": _float,
    "bool": _bool,
    "str": _str,
    "bytes": _bytes,
    "literal": _choice,
    "tensor": _tensor,
    "record": _record,
    "tuple": _tuple,
}


def _check_range(
    value: float, rule: Rule, path: str, low: float | None, high: float | None
) -> None:
    if rule.ge is not None and not value >= rule.ge:
        raise MalformedMessage(f"{path}: must be >= {rule.ge}, got {value}")
    if rule.gt is not None and not value > rule.gt:
        raise MalformedMessage(f"{path}: must be > {rule.gt}, got {value}")
    if rule.le is not None and not value <= rule.le:
        raise MalformedMessage(f"{path}: must be <= {rule.le}, got {value}")
    if rule.lt is not None and not value < rule.lt:
        raise MalformedMessage(f"{path}: must be < {rule.lt}, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise MalformedMessage(f"{path}: {value} does not fit in 64 bits")


def _check_length(size: int, rule: Rule, path: str, unit: str, default_max: int | None) -> None:
    most = rule.max_len if rule.max_len is not None else default_max
    if rule.min_len is not None and size < rule.min_len:
        raise MalformedMessage(f"{path}: must have at least {rule.min_len} {unit}, got {size}")
    if most is not None and size > most:
        raise MalformedMessage(f"{path}: must have at most {most} {unit}, got {size}")


def check_items(count: int, rule: Rule, path: str) -> None:
    """A list's length against its field's min_items/max_items (DEFAULT_MAX_ITEMS at most)."""
    most = rule.max_items if rule.max_items is not None else DEFAULT_MAX_ITEMS
    if rule.min_items is not None and count < rule.min_items:
        raise MalformedMessage(f"{path}: must have at least {rule.min_items} items, got {count}")
    if count > most:
        raise MalformedMessage(f"{path}: must have at most {most} items, got {count}")


def describe(value: Any) -> str:
    """A bad value as an error message shows it: its type and a short repr, or its size."""
    if isinstance(value, bytes | bytearray | memoryview):
        return f"{len(value)} bytes of binary"
    if isinstance(value, dict):
        return f"a map of {len(value)} entries"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} items"
    return f"{type(value).__name__} {value!r:.60}"


# --- what a field can cost a decoder -------------------------------------------------------------

TENSOR_OBJECTS = 13 + 16
"""Values in an encoded tensor map: the map, six keys and six values, and a shape of up to 16
sizes (wire.tensors.MAX_NDIM)."""


def object_bound(fields: tuple[WireField, ...]) -> int:
    """Most msgpack values a valid map of `fields` holds (the map, its keys, its values, and
    everything nested in them): the budget a decoder gives a body before it reads it."""
    return 1 + sum(1 + _value_bound(field) for field in fields)


def _value_bound(field: WireField) -> int:
    if field.kind == "tensor":
        return TENSOR_OBJECTS
    if field.kind == "record":
        assert field.record is not None
        return object_bound(field.record._wire_fields)  # type: ignore[attr-defined]
    if field.kind == "tuple":
        assert field.item is not None
        most = field.rule.max_items if field.rule.max_items is not None else DEFAULT_MAX_ITEMS
        return 1 + most * _value_bound(field.item)
    return 1
