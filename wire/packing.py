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

MAX_OBJECTS = 1 << 18
"""Most values (containers, keys and items each count one) decoded from one frame unless the
message type allows fewer (wire.schema gives each type a budget from its schema). Parsing costs
about a microsecond and a few dozen bytes per value in Python, so a frame of 16 MiB of one-byte
empty maps would otherwise cost seconds of the event loop and gigabytes; 2^18 covers the largest
legitimate frame (a `generate` of 2^17 token ids) twice over."""

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


def unpack(body: bytes | bytearray | memoryview, *, max_objects: int = MAX_OBJECTS) -> Any:
    """Decode one msgpack value that must fill `body` exactly.

    Binary values come back as memoryviews into `body` (writable if `body` is: FrameDecoder owns
    each body alone, so a decoder may copy out of it with torch's threads). Raises MalformedFrame
    (a ProtocolError) for anything else than one well-formed value within the limits above,
    `max_objects` values in all (containers, keys and items each count one).
    """
    reader = Reader(body, max_objects=max_objects)
    value = reader.value()
    reader.finish()
    return value


class Reader:
    """Values read one after another from a frame body, within an object budget.

    `unpack` reads one value; the message decoder reads an envelope's keys one at a time, so it
    can refuse a message by its type before reading the body, and give the body a budget that
    fits its type (`budget` may be set between values). Raises MalformedFrame.
    """

    def __init__(self, body: bytes | bytearray | memoryview, *, max_objects: int) -> None:
        self.buf = byte_view(body)
        self.pos = 0
        self.budget = max_objects  # values that may still be made

    @property
    def at_end(self) -> bool:
        return self.pos >= len(self.buf)

    def value(self, depth: int = 0) -> Any:
        """The next value (nesting counted from `depth`)."""
        try:
            value, self.pos = self._unpack(self.pos, depth)
        except (IndexError, struct.error):
            raise MalformedFrame(
                f"frame body of {len(self.buf)} bytes ends in the middle of a msgpack value"
            ) from None
        return value

    def map_header(self) -> int:
        """The entry count of the map that starts here (its entries are read with `value`)."""
        kind = self.buf[self.pos] if not self.at_end else None
        if kind is not None and 0x80 <= kind < 0x90:
            count, self.pos = kind & 0x0F, self.pos + 1
        elif kind in (0xDE, 0xDF):
            length = _U16 if kind == 0xDE else _U32
            _need(self.buf, self.pos + 1, length.size, "map length")
            count = length.unpack_from(self.buf, self.pos + 1)[0]
            self.pos += 1 + length.size
        else:
            return -1
        self._count(1)
        if count > MAX_MAP_LEN:
            raise MalformedFrame(f"map of {count} entries is over the {MAX_MAP_LEN}-entry limit")
        _need(self.buf, self.pos, 2 * count, f"map of {count} entries")
        return int(count)

    def finish(self) -> None:
        """Check that the body held nothing after the values read."""
        if self.pos != len(self.buf):
            raise MalformedFrame(
                f"frame body has {len(self.buf) - self.pos} bytes left after its msgpack value "
                f"(a frame carries exactly one value)"
            )

    def _count(self, objects: int) -> None:
        self.budget -= objects
        if self.budget < 0:
            raise MalformedFrame(
                "frame holds more values than its message type can have: refused before "
                "decoding the rest (a peer building objects to exhaust memory or time)"
            )

    def _unpack(self, pos: int, depth: int) -> tuple[Any, int]:
        buf = self.buf
        kind = buf[pos]
        pos += 1
        self._count(1)
        if kind < 0x80:  # positive fixint
            return kind, pos
        if kind >= 0xE0:  # negative fixint
            return kind - 0x100, pos
        if kind < 0x90:
            return self._map(pos, kind & 0x0F, depth)
        if kind < 0xA0:
            return self._array(pos, kind & 0x0F, depth)
        if kind < 0xC0:
            return _str(buf, pos, kind & 0x1F)
        if kind in _CONSTANTS:
            return _CONSTANTS[kind], pos
        number = _NUMBERS.get(kind)
        if number is not None:
            return number.unpack_from(buf, pos)[0], pos + number.size
        sized = _SIZED.get(kind)
        if sized is not None:
            length, container = sized
            count = length.unpack_from(buf, pos)[0]
            pos += length.size
            if container == "str":
                return _str(buf, pos, count)
            if container == "bin":
                return _bin(buf, pos, count)
            if container == "array":
                return self._array(pos, count, depth)
            return self._map(pos, count, depth)
        if kind == 0xC1:
            raise MalformedFrame(f"byte 0xc1 at offset {pos - 1} is never used in msgpack")
        raise MalformedFrame(
            f"msgpack ext type (0x{kind:02x}) at offset {pos - 1}: peerd frames never carry ext "
            "types"
        )

    def _array(self, pos: int, count: int, depth: int) -> tuple[list[Any], int]:
        if count > MAX_ARRAY_LEN:
            raise MalformedFrame(f"array of {count} items is over the {MAX_ARRAY_LEN}-item limit")
        _need(self.buf, pos, count, f"array of {count} items")  # an item takes >= 1 byte
        if depth + 1 > MAX_DEPTH:
            raise MalformedFrame(f"value nests deeper than {MAX_DEPTH} levels")
        if count > self.budget:  # refused before building any of it
            self._count(count)
        items = []
        for _ in range(count):
            item, pos = self._unpack(pos, depth + 1)
            items.append(item)
        return items, pos

    def _map(self, pos: int, count: int, depth: int) -> tuple[dict[str, Any], int]:
        if count > MAX_MAP_LEN:
            raise MalformedFrame(f"map of {count} entries is over the {MAX_MAP_LEN}-entry limit")
        _need(self.buf, pos, 2 * count, f"map of {count} entries")  # a key and a value
        if depth + 1 > MAX_DEPTH:
            raise MalformedFrame(f"value nests deeper than {MAX_DEPTH} levels")
        if 2 * count > self.budget:
            self._count(2 * count)
        result: dict[str, Any] = {}
        for _ in range(count):
            key_at = pos
            key, pos = self._unpack(pos, depth + 1)
            if type(key) is not str:
                raise MalformedFrame(
                    f"map key at offset {key_at} is a {type(key).__name__}: peerd map keys are "
                    "strings"
                )
            if key in result:
                raise MalformedFrame(f"map has the key {key!r} twice")
            result[key], pos = self._unpack(pos, depth + 1)
        return result, pos


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
_SIZED: dict[int, tuple[struct.Struct, str]] = {
    0xC4: (_U8, "bin"),
    0xC5: (_U16, "bin"),
    0xC6: (_U32, "bin"),
    0xD9: (_U8, "str"),
    0xDA: (_U16, "str"),
    0xDB: (_U32, "str"),
    0xDC: (_U16, "array"),
    0xDD: (_U32, "array"),
    0xDE: (_U16, "map"),
    0xDF: (_U32, "map"),
}
