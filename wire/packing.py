"""MessagePack for frame bodies: a strict subset, hard limits, and binaries that are never copied
twice.

Encoding writes standard msgpack with msgpack's own `Packer` for every scalar, so the bytes equal
`msgpack.packb(obj, use_bin_type=True)`; the only difference is that a large binary value is kept
as a separate part (a view of the caller's memory, e.g. a tensor) instead of being copied into the
packer, so a frame is assembled with one copy of its payload (see `wire.framing.encode_frame`).

Decoding is a small recursive-descent parser instead of `msgpack.unpackb` because unpackb copies
every binary value into a new `bytes` object: for hidden states that is a second full copy of the
payload on a path whose budget is about one copy (the `peerd bench wire` target is half of
`torch.clone` bandwidth for encode+decode together). Here a binary value comes back as a
`memoryview` into the frame body. The parser accepts exactly the subset peerd emits: nil, bool,
int (up to 64 bits), float32/float64, str (valid UTF-8), bin, array, map with str keys; never ext
types, never duplicate keys, and every length is checked against the limits below and against the
bytes actually left in the frame before anything is allocated.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack

from wire.errors import MalformedFrame

# Limits on what one frame body may contain. The frame size limit already bounds the bytes; these
# bound the Python objects a small frame can make (a 16-byte frame must not ask for a list of 4
# billion items) and the recursion depth.
MAX_DEPTH = 16
"""Deepest nesting accepted. The deepest peerd value is 5 levels (envelope > body > swarm list >
server record > addrs list); 16 leaves room to grow and keeps recursion far from Python's limit."""

MAX_ARRAY_LEN = 1 << 17
"""Longest array accepted: Generate.input_ids for a full 128k-token context is the longest list any
message carries; everything else (shapes, addrs, hops, records) is tiny."""

MAX_MAP_LEN = 256
"""Most entries in one map: a message body or record has at most a few dozen fields."""

MAX_STR_LEN = 4 << 20
"""Longest UTF-8 string in bytes: a prompt that fills a 128k-token context is about 0.5 MB of text,
so 4 MiB is 8x headroom while bounding what one string can cost."""

LARGE_BINARY = 64 << 10
"""Binary values at least this long are kept out of the packer's buffer when encoding (copied once,
straight into the frame); smaller ones are cheaper to copy through msgpack."""

_BIN8, _BIN16, _BIN32 = 0xC4, 0xC5, 0xC6
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_F32 = struct.Struct(">f")
_F64 = struct.Struct(">d")

Part = bytes | memoryview


# --- encoding ---------------------------------------------------------------------------------


def pack_parts(obj: Any) -> list[Part]:
    """Encode `obj` as msgpack into parts whose concatenation is the encoding.

    Large binaries appear as their own `memoryview` parts (no copy yet); all else is in `bytes`
    parts. Raises TypeError for a value msgpack cannot carry here (e.g. a set, a non-str map key)
    and ValueError for one over the decoder's limits, so nothing is sent that a peer would refuse.
    """
    packer = msgpack.Packer(autoreset=False, use_bin_type=True)
    parts: list[Part] = []
    _pack(obj, packer, parts, 0)
    tail = packer.bytes()
    if tail or not parts:
        parts.append(tail)
    return parts


def packb(obj: Any) -> bytes:
    """Encode `obj` as one bytes object (small values; frames use `pack_parts`)."""
    return b"".join(pack_parts(obj))


def _pack(obj: Any, packer: msgpack.Packer, parts: list[Part], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"value nests deeper than {MAX_DEPTH} levels")
    if obj is None or isinstance(obj, float):
        packer.pack(obj)
    elif isinstance(obj, int):
        if not -(1 << 63) <= obj < 1 << 64:
            raise ValueError(f"integer {obj} does not fit msgpack's 64 bits")
        packer.pack(obj)
    elif isinstance(obj, str):
        if len(obj) * 4 > MAX_STR_LEN and len(obj.encode("utf-8", "surrogatepass")) > MAX_STR_LEN:
            raise ValueError(f"string of {len(obj)} characters is over {MAX_STR_LEN} bytes")
        packer.pack(obj)
    elif isinstance(obj, dict):
        if len(obj) > MAX_MAP_LEN:
            raise ValueError(f"map of {len(obj)} entries is over the {MAX_MAP_LEN}-entry limit")
        packer.pack_map_header(len(obj))
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"map keys must be str, got {type(key).__name__}: {key!r}")
            packer.pack(key)
            _pack(value, packer, parts, depth + 1)
    elif isinstance(obj, list | tuple):
        if len(obj) > MAX_ARRAY_LEN:
            raise ValueError(f"array of {len(obj)} items is over the {MAX_ARRAY_LEN}-item limit")
        packer.pack_array_header(len(obj))
        for value in obj:
            _pack(value, packer, parts, depth + 1)
    elif isinstance(obj, bytes | bytearray | memoryview):
        view = byte_view(obj)
        if len(view) >= LARGE_BINARY:
            parts.append(packer.bytes())
            packer.reset()
            parts.append(_bin_header(len(view)))
            parts.append(view)
        else:
            packer.pack(view)
    else:
        raise TypeError(f"cannot encode a {type(obj).__name__} in a frame: {obj!r:.80}")


def byte_view(obj: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of a bytes-like object (no copy)."""
    view = memoryview(obj)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("binary values must be C-contiguous buffers")
        view = view.cast("B")
    return view


def _bin_header(size: int) -> bytes:
    if size < 1 << 8:
        return bytes((_BIN8, size))
    if size < 1 << 16:
        return bytes((_BIN16,)) + _U16.pack(size)
    if size < 1 << 32:
        return bytes((_BIN32,)) + _U32.pack(size)
    raise ValueError(f"binary value of {size} bytes is over msgpack's 4 GiB limit")


# --- decoding ---------------------------------------------------------------------------------


def unpack(body: bytes | bytearray | memoryview) -> Any:
    """Decode one msgpack value that must fill `body` exactly.

    Binary values come back as memoryviews into `body` (writable if `body` is: FrameDecoder owns
    each body alone, so a decoder may copy out of it with torch's threads). Raises MalformedFrame
    (a ProtocolError) for anything else than one well-formed value within the limits above.
    """
    buf = byte_view(body)
    try:
        value, pos = _unpack(buf, 0, 0)
    except (IndexError, struct.error):
        raise MalformedFrame(
            f"frame body of {len(buf)} bytes ends in the middle of a msgpack value"
        ) from None
    if pos != len(buf):
        raise MalformedFrame(
            f"frame body has {len(buf) - pos} bytes left after its msgpack value "
            f"(a frame carries exactly one value)"
        )
    return value


def _unpack(buf: memoryview, pos: int, depth: int) -> tuple[Any, int]:
    kind = buf[pos]
    pos += 1
    if kind < 0x80:  # positive fixint
        return kind, pos
    if kind >= 0xE0:  # negative fixint
        return kind - 0x100, pos
    if kind < 0x90:
        return _map(buf, pos, kind & 0x0F, depth)
    if kind < 0xA0:
        return _array(buf, pos, kind & 0x0F, depth)
    if kind < 0xC0:
        return _str(buf, pos, kind & 0x1F)
    if kind in _CONSTANTS:
        return _CONSTANTS[kind], pos
    number = _NUMBERS.get(kind)
    if number is not None:
        return number.unpack_from(buf, pos)[0], pos + number.size
    sized = _SIZED.get(kind)
    if sized is not None:
        length, read = sized
        return read(buf, pos + length.size, length.unpack_from(buf, pos)[0], depth)
    if kind == 0xC1:
        raise MalformedFrame(f"byte 0xc1 at offset {pos - 1} is never used in msgpack")
    raise MalformedFrame(
        f"msgpack ext type (0x{kind:02x}) at offset {pos - 1}: peerd frames never carry ext types"
    )


def _need(buf: memoryview, pos: int, size: int, what: str) -> None:
    if size > len(buf) - pos:
        raise MalformedFrame(
            f"{what} at offset {pos} claims {size} bytes but only {max(len(buf) - pos, 0)} "
            "are left in the frame"
        )


def _str(buf: memoryview, pos: int, size: int) -> tuple[str, int]:
    if size > MAX_STR_LEN:
        raise MalformedFrame(f"string of {size} bytes is over the {MAX_STR_LEN}-byte limit")
    _need(buf, pos, size, "string")
    try:
        text = str(buf[pos : pos + size], "utf-8")
    except UnicodeDecodeError as error:
        raise MalformedFrame(
            f"string at offset {pos} is not valid UTF-8 ({error.reason})"
        ) from None
    return text, pos + size


def _bin(buf: memoryview, pos: int, size: int) -> tuple[memoryview, int]:
    _need(buf, pos, size, "binary value")
    return buf[pos : pos + size], pos + size


def _array(buf: memoryview, pos: int, count: int, depth: int) -> tuple[list[Any], int]:
    if count > MAX_ARRAY_LEN:
        raise MalformedFrame(f"array of {count} items is over the {MAX_ARRAY_LEN}-item limit")
    _need(buf, pos, count, f"array of {count} items")  # every item takes at least one byte
    if depth + 1 > MAX_DEPTH:
        raise MalformedFrame(f"value nests deeper than {MAX_DEPTH} levels")
    items = []
    for _ in range(count):
        item, pos = _unpack(buf, pos, depth + 1)
        items.append(item)
    return items, pos


def _map(buf: memoryview, pos: int, count: int, depth: int) -> tuple[dict[str, Any], int]:
    if count > MAX_MAP_LEN:
        raise MalformedFrame(f"map of {count} entries is over the {MAX_MAP_LEN}-entry limit")
    _need(buf, pos, 2 * count, f"map of {count} entries")  # a key and a value: two bytes at least
    if depth + 1 > MAX_DEPTH:
        raise MalformedFrame(f"value nests deeper than {MAX_DEPTH} levels")
    result: dict[str, Any] = {}
    for _ in range(count):
        key_at = pos
        key, pos = _unpack(buf, pos, depth + 1)
        if type(key) is not str:
            raise MalformedFrame(
                f"map key at offset {key_at} is a {type(key).__name__}: peerd map keys are strings"
            )
        if key in result:
            raise MalformedFrame(f"map has the key {key!r} twice")
        result[key], pos = _unpack(buf, pos, depth + 1)
    return result, pos


# Type bytes past the fixed-size ranges: nil and the booleans, the numbers (each a struct), and
# the values whose length follows the type byte (str, bin, array and map, read at that length).
_CONSTANTS: dict[int, Any] = {0xC0: None, 0xC2: False, 0xC3: True}
_NUMBERS: dict[int, struct.Struct] = {
    0xCA: _F32,
    0xCB: _F64,
    0xCC: _U8,
    0xCD: _U16,
    0xCE: _U32,
    0xCF: _U64,
    0xD0: _I8,
    0xD1: _I16,
    0xD2: _I32,
    0xD3: _I64,
}
_Reader = Callable[[memoryview, int, int, int], tuple[Any, int]]


def _str_of(buf: memoryview, pos: int, size: int, depth: int) -> tuple[str, int]:
    return _str(buf, pos, size)


def _bin_of(buf: memoryview, pos: int, size: int, depth: int) -> tuple[memoryview, int]:
    return _bin(buf, pos, size)


_SIZED: dict[int, tuple[struct.Struct, _Reader]] = {
    0xC4: (_U8, _bin_of),
    0xC5: (_U16, _bin_of),
    0xC6: (_U32, _bin_of),
    0xD9: (_U8, _str_of),
    0xDA: (_U16, _str_of),
    0xDB: (_U32, _str_of),
    0xDC: (_U16, _array),
    0xDD: (_U32, _array),
    0xDE: (_U16, _map),
    0xDF: (_U32, _map),
}
