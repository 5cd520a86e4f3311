"""wire.packing: our msgpack subset agrees with the msgpack library byte for byte, and refuses
everything outside the subset or over the limits with MalformedFrame."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire import MalformedFrame
from wire.packing import (
    LARGE_BINARY,
    MAX_ARRAY_LEN,
    MAX_DEPTH,
    MAX_MAP_LEN,
    MAX_STR_LEN,
    pack_parts,
    packb,
    unpack,
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=10), children, max_size=6)
    ),
    max_leaves=30,
)


def plain(value: object) -> object:
    """Binary values as bytes, for comparison (unpack gives memoryviews)."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


@settings(max_examples=300, deadline=None)
@given(values)
def test_pack_matches_msgpack_library_and_round_trips(value: object) -> None:
    encoded = packb(value)
    assert encoded == msgpack.packb(value, use_bin_type=True)
    assert plain(unpack(encoded)) == value
    assert plain(unpack(encoded)) == msgpack.unpackb(encoded, raw=False, strict_map_key=False)


def test_large_binary_is_a_separate_view_not_a_copy() -> None:
    payload = bytearray(LARGE_BINARY)
    parts = pack_parts({"data": payload})
    views = [part for part in parts if isinstance(part, memoryview)]
    assert len(views) == 1 and views[0].obj is payload
    assert b"".join(parts) == msgpack.packb({"data": bytes(payload)}, use_bin_type=True)


def test_binary_values_come_back_as_views_into_the_body() -> None:
    body = bytearray(packb({"a": b"xyz"}))
    value = unpack(body)["a"]
    assert isinstance(value, memoryview) and value.obj is body and bytes(value) == b"xyz"


def test_float32_is_accepted() -> None:
    assert unpack(b"\xca" + struct.pack(">f", 1.5)) == 1.5


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "ends in the middle"),
        (b"\x92\x01", "array of 2 items at offset 1 claims 2 bytes"),
        (b"\xcd\x01", "ends in the middle"),
        (b"\x01\x02", "bytes left after"),
        (b"\xc1", "never used"),
        (b"\xd4\x01\x02", "ext type"),
        (b"\xc7\x01\x01\x00", "ext type"),
        (b"\xa2\xff\xfe", "not valid UTF-8"),
        (b"\x81\x01\x02", "map key at offset 1 is a int"),
        (b"\x82\xa1a\x01\xa1a\x02", "key 'a' twice"),
        (b"\xc6\xff\xff\xff\xff", "claims 4294967295 bytes"),
        (b"\xdd\xff\xff\xff\xff", f"over the {MAX_ARRAY_LEN}-item limit"),
        (b"\xdd\x00\x00\x10\x00", "claims 4096 bytes"),
        (b"\xdf\xff\xff\xff\xff", f"over the {MAX_MAP_LEN}-entry limit"),
        (b"\xdb\xff\xff\xff\xff", f"over the {MAX_STR_LEN}-byte limit"),
        (b"\x91" * (MAX_DEPTH + 1) + b"\x00", "deeper than"),
    ],
)
def test_malformed_bodies_raise_malformed_frame(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedFrame, match=reason):
        unpack(data)


def test_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(TypeError, match="map keys must be str"):
        packb({1: 2})
    with pytest.raises(TypeError, match="cannot encode a set"):
        packb({1, 2})
    with pytest.raises(ValueError, match="does not fit"):
        packb(1 << 64)
    with pytest.raises(ValueError, match="deeper than"):
        packb([[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]])
    with pytest.raises(ValueError, match="entry limit"):
        packb({str(i): i for i in range(MAX_MAP_LEN + 1)})
