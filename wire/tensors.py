"""Tensor codec: a torch tensor to a msgpack map and back, raw or compressed (docs/wire.md#tensors).

An encoded tensor is a map `{"dtype", "shape", "codec", "lz4", "data"[, "scales"]}`. `codec` is one
of `raw` (the tensor's own bytes), `float16` and `bfloat16` (floating tensors cast for the trip),
or `int8-blockwise` (absmax quantisation per block of 64 values, one float32 scale per block);
`lz4` wraps `data` in an LZ4 block. Lossy codecs apply to floating tensors only: on an integer or
bool tensor the encoder falls back to `raw` (the tensor arrives exact, and the map says `raw`), and
the decoder refuses a lossy codec on a non-floating dtype.

Speed: encoding does not copy a contiguous tensor (`data` is a view of its memory, copied once into
the frame); decoding copies `data` once into a fresh buffer the result owns, so a decoded tensor is
writable and never aliases the frame it came from. Buffers come from numpy, which asks the kernel
for huge pages: at 32 MiB that alone halves the cost of touching fresh memory.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lz4.block
import numpy as np
import torch

from wire.buffers import HUGE_PAGE_ALLOCATION, allocate, copy_bytes
from wire.errors import MalformedTensor
from wire.packing import byte_view

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Wire name of every dtype the codec carries (all little-endian)."""

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

CODECS = ("raw", "float16", "bfloat16", "int8-blockwise")
LOSSY_CODECS = frozenset({"float16", "bfloat16", "int8-blockwise"})

INT8_BLOCK_SIZE = 64
"""Values per int8-blockwise block: one float32 scale per 64 int8 values is 6% overhead, and a
block small enough that one outlier only coarsens its 63 neighbours (bitsandbytes uses 64-4096)."""

MAX_NDIM = 16
"""Most dimensions a decoded tensor may have; hidden states have 3."""

MAX_DIM = (1 << 31) - 1
"""Largest single dimension: no real tensor exceeds int32 along one axis, and the bound keeps an
empty tensor's shape (where the byte count is 0 whatever the other dimensions) from overflowing
torch."""

DEFAULT_MAX_TENSOR_BYTES = 256 << 20
"""Default cap on a decoded tensor's size, equal to the default frame limit
(`wire.framing.DEFAULT_MAX_FRAME_SIZE`): lz4 can make a tensor bigger than its frame, and this keeps
a small frame from asking for more memory than a large one could."""

LZ4_MAX_RATIO = 255
"""An LZ4 block cannot expand more than ~255x (a match length grows by at most 255 per input byte),
so a claim beyond that is refused before allocating the output."""

_SCALE_DTYPE = np.dtype("<f4")
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True)
class Compression:
    """How tensors travel: a codec, optionally lz4-wrapped. `Compression.parse("float16+lz4")`."""

    codec: str = "raw"
    lz4: bool = False

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"unknown tensor codec {self.codec!r}: use one of {', '.join(CODECS)}")

    @classmethod
    def parse(cls, name: str) -> Compression:
        """`raw`, `lz4` (= raw+lz4), `float16`, `float16+lz4`, ..., `int8-blockwise+lz4`."""
        if name == "lz4":
            return cls("raw", True)
        codec, plus, wrapper = name.partition("+")
        if plus and wrapper != "lz4":
            raise ValueError(f"unknown tensor compression {name!r}: only '+lz4' can be appended")
        return cls(codec, bool(plus))

    @property
    def name(self) -> str:
        return f"{self.codec}+lz4" if self.lz4 else self.codec

    @property
    def lossy(self) -> bool:
        return self.codec in LOSSY_CODECS


COMPRESSIONS = tuple(Compression(codec, lz4).name for codec in CODECS for lz4 in (False, True))
"""Every compression name: raw, raw+lz4, float16, float16+lz4, ... (raw+lz4 is also `lz4`)."""


def as_compression(compression: Compression | str) -> Compression:
    return compression if isinstance(compression, Compression) else Compression.parse(compression)


# --- encoding ---------------------------------------------------------------------------------


def encode_tensor(tensor: torch.Tensor, compression: Compression | str = "raw") -> dict[str, Any]:
    """Encode `tensor` as a msgpack-ready map.

    `data` (and `scales`) may be views of the tensor's memory: pack the map before writing to the
    tensor again. A lossy codec on an integer or bool tensor falls back to `raw`. Raises TypeError
    or ValueError for a tensor the codec cannot carry (complex dtype, sparse layout, inf/nan with
    int8-blockwise).
    """
    comp = as_compression(compression)
    _check_host()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise ValueError(
            f"dtype {tensor.dtype} has no wire encoding: use one of {', '.join(DTYPES)}"
        )
    if tensor.layout != torch.strided:
        raise ValueError(f"only dense tensors have a wire encoding, got layout {tensor.layout}")
    flat = tensor.detach().cpu().reshape(-1)  # a view when contiguous, else one copy
    codec = comp.codec if tensor.is_floating_point() else "raw"
    scales: torch.Tensor | None = None
    if codec == "raw":
        payload = flat
    elif codec in ("float16", "bfloat16"):
        payload = _converted(flat, torch.float16 if codec == "float16" else torch.bfloat16)
    else:
        payload, scales = _quantize_int8_blockwise(flat)
    data: bytes | memoryview = _bytes_of(payload)
    if comp.lz4:
        data = lz4.block.compress(data, store_size=False)
    encoded: dict[str, Any] = {
        "dtype": dtype_name,
        "shape": list(tensor.shape),
        "codec": codec,
        "lz4": comp.lz4,
    }
    if scales is not None:
        encoded["scales"] = _bytes_of(scales)
    encoded["data"] = data  # last: the bulk of the frame, after everything needed to read it
    return encoded


def _quantize_int8_blockwise(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float32 scales: q = round(x / s), s = absmax(block) / 127."""
    count = flat.numel()
    blocks = -(-count // INT8_BLOCK_SIZE)
    if flat.dtype == torch.float32 and count % INT8_BLOCK_SIZE == 0:
        values = flat.view(blocks, INT8_BLOCK_SIZE)
    else:
        values = _empty(blocks * INT8_BLOCK_SIZE, torch.float32)
        values[:count].copy_(flat)
        values[count:].zero_()
        values = values.view(blocks, INT8_BLOCK_SIZE)
    work = _empty(blocks * INT8_BLOCK_SIZE, torch.float32).view(blocks, INT8_BLOCK_SIZE)
    absmax = torch.abs(values, out=work).amax(dim=1)
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError(
            "int8-blockwise cannot encode inf or nan (or float64 beyond float32 range): "
            "send this tensor raw, float16 or bfloat16"
        )
    scales = absmax / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    torch.mul(values, inverse[:, None], out=work).round_().clamp_(-127, 127)
    quantized = _empty(blocks * INT8_BLOCK_SIZE, torch.int8)
    quantized.view(blocks, INT8_BLOCK_SIZE).copy_(work)
    return quantized[:count], scales


def _dequantize_int8_blockwise(
    quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    count = quantized.numel()
    blocks = scales.numel()
    values = _empty(blocks * INT8_BLOCK_SIZE, torch.float32)
    values[:count].copy_(quantized)
    values[count:].zero_()
    values.view(blocks, INT8_BLOCK_SIZE).mul_(scales[:, None])
    return _converted(values[:count], dtype)


def _empty(count: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor; large ones in numpy-allocated memory (huge pages)."""
    if count * dtype.itemsize < HUGE_PAGE_ALLOCATION:
        return torch.empty(count, dtype=dtype)
    return torch.from_numpy(np.empty(count * dtype.itemsize, np.uint8)).view(dtype)


def _converted(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`flat.to(dtype)` into numpy-allocated memory (no copy when already `dtype`)."""
    if flat.dtype == dtype:
        return flat
    return _empty(flat.numel(), dtype).copy_(flat)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a 1-D contiguous CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return _uint8_view(tensor).numpy().data


def _uint8_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of `tensor` as a flat uint8 tensor (a view when it is contiguous)."""
    flat = tensor.contiguous()
    # contiguous() may keep any stride on a size-1 or empty dimension, which view(uint8) refuses
    flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


# --- decoding ---------------------------------------------------------------------------------


ShapeCheck = Callable[[list[int]], None]
"""A receiver's own rule on a tensor's shape (e.g. a server's hidden size): raises ValueError
with the reason to refuse it."""


def decode_tensor(
    value: object,
    *,
    max_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    check_shape: ShapeCheck | None = None,
) -> torch.Tensor:
    """Decode an encoded tensor map; every field is checked first, the shape also with
    `check_shape`, all before anything is allocated or decompressed. Raises MalformedTensor."""
    _check_host()
    header = _read_header(value, max_bytes, check_shape)
    if header.codec == "raw":
        result = _decode_raw(header)
    elif header.codec in ("float16", "bfloat16"):
        result = _decode_half(header)
    else:
        result = _decode_int8_blockwise(header)
    return result.reshape(header.shape)


@dataclass(frozen=True)
class _Header:
    """An encoded tensor's fields, each checked on its own and against the others."""

    dtype: torch.dtype
    shape: list[int]
    count: int  # values
    codec: str
    compressed: bool  # lz4
    data: bytes | bytearray | memoryview
    scales: object  # int8-blockwise's scales (checked by its decoder); None with other codecs

    @property
    def size(self) -> int:
        return self.count * self.dtype.itemsize


def _read_header(value: object, max_bytes: int, check_shape: ShapeCheck | None) -> _Header:
    if not isinstance(value, dict):
        raise MalformedTensor(
            f"an encoded tensor is a map with dtype, shape, codec and data; got {_kind(value)}"
        )
    dtype_name = value.get("dtype")
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise MalformedTensor(
            f"tensor dtype {dtype_name!r} is not one of {', '.join(DTYPES)}"
            + ("" if "dtype" in value else " (the dtype field is missing)")
        )
    shape = _shape(value.get("shape"))
    if check_shape is not None:
        try:
            check_shape(shape)
        except ValueError as error:
            raise MalformedTensor(str(error)) from None
    size = math.prod(shape) * dtype.itemsize
    if size > max_bytes:
        raise MalformedTensor(
            f"tensor of shape {shape} and dtype {dtype_name} is {size} bytes, over the "
            f"{max_bytes}-byte limit (the tensors of one message share the frame limit)"
        )
    codec = _codec(value, dtype)
    compressed = value.get("lz4", False)
    if not isinstance(compressed, bool):
        raise MalformedTensor(f"tensor field lz4 must be true or false, got {_kind(compressed)}")
    data = value.get("data")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedTensor(f"tensor field data must be binary, got {_kind(data)}")
    scales = value.get("scales")
    if (scales is not None) != (codec == "int8-blockwise"):
        raise MalformedTensor(
            "tensor field scales is required with codec int8-blockwise and only with it"
        )
    return _Header(dtype, shape, math.prod(shape), codec, compressed, data, scales)


def _codec(value: dict[str, Any], dtype: torch.dtype) -> str:
    codec = value.get("codec")
    if not isinstance(codec, str) or codec not in CODECS:
        raise MalformedTensor(f"tensor codec {codec!r} is not one of {', '.join(CODECS)}")
    if codec in LOSSY_CODECS and not dtype.is_floating_point:
        raise MalformedTensor(
            f"codec {codec} applies to floating tensors only, not {value['dtype']} (send it raw)"
        )
    return codec


def _decode_raw(header: _Header) -> torch.Tensor:
    result = _tensor_of(_payload(header.data, header.size, header.compressed), header.dtype)
    if header.dtype == torch.bool and header.count and int(result.view(torch.uint8).max()) > 1:
        raise MalformedTensor("bool tensor data holds bytes other than 0 and 1")
    return result


def _decode_half(header: _Header) -> torch.Tensor:
    wire_dtype = torch.float16 if header.codec == "float16" else torch.bfloat16
    payload = _payload(header.data, header.count * 2, header.compressed)
    return _converted(_tensor_of(payload, wire_dtype), header.dtype)


def _decode_int8_blockwise(header: _Header) -> torch.Tensor:
    scales_data, count = header.scales, header.count
    if not isinstance(scales_data, bytes | bytearray | memoryview):
        raise MalformedTensor(f"tensor field scales must be binary, got {_kind(scales_data)}")
    blocks = -(-count // INT8_BLOCK_SIZE)
    if len(scales_data) != blocks * 4:
        raise MalformedTensor(
            f"int8-blockwise tensor of {count} values has {blocks} blocks and needs "
            f"{blocks * 4} bytes of float32 scales, got {len(scales_data)}"
        )
    quantized = _tensor_of(_payload(header.data, count, header.compressed), torch.int8)
    scales = _tensor_of(_payload(scales_data, blocks * 4, False), torch.float32)
    return _dequantize_int8_blockwise(quantized, scales, header.dtype)


def _shape(shape: object) -> list[int]:
    if not isinstance(shape, list | tuple):
        raise MalformedTensor(f"tensor shape must be a list of sizes, got {_kind(shape)}")
    if len(shape) > MAX_NDIM:
        raise MalformedTensor(f"tensor has {len(shape)} dimensions, over the limit of {MAX_NDIM}")
    for size in shape:
        if type(size) is not int or not 0 <= size <= MAX_DIM:
            raise MalformedTensor(
                f"tensor shape {list(shape)!r:.200} must hold sizes from 0 to {MAX_DIM}"
            )
    return list(shape)


def _payload(data: bytes | bytearray | memoryview, size: int, compressed: bool) -> memoryview:
    """The codec payload of `size` bytes: a fresh, writable buffer the caller may keep."""
    if not compressed:
        if len(data) != size:
            raise MalformedTensor(
                f"tensor data is {len(data)} bytes but its dtype, shape and codec need {size}"
            )
        out = allocate(size)
        copy_bytes(out, byte_view(data))
        return out
    if size > LZ4_MAX_RATIO * len(data) + 64:
        raise MalformedTensor(
            f"lz4 data of {len(data)} bytes cannot expand to the {size} bytes that the tensor's "
            "dtype, shape and codec need"
        )
    try:
        raw = lz4.block.decompress(data, uncompressed_size=size, return_bytearray=True)
    except (lz4.block.LZ4BlockError, ValueError) as error:
        raise MalformedTensor(f"tensor data is not a valid lz4 block: {error}") from None
    if len(raw) != size:
        raise MalformedTensor(
            f"lz4 tensor data expands to {len(raw)} bytes but its dtype, shape and codec need "
            f"{size}"
        )
    return memoryview(raw)


def _tensor_of(payload: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor sharing the writable `payload` buffer (owned by nobody else)."""
    if not payload:
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(np.frombuffer(payload, np.uint8)).view(dtype)


def _kind(value: object) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return f"{len(value)} bytes of binary"
    return f"{type(value).__name__} {value!r:.60}"


def _check_host() -> None:
    if not _LITTLE_ENDIAN:
        raise NotImplementedError("the tensor codec is little-endian only; this host is not")


# --- measuring --------------------------------------------------------------------------------


def max_abs_error(original: torch.Tensor, decoded: torch.Tensor) -> float:
    """Largest |original - decoded| over all values (0.0 for equal values, equal infs, both nan)."""
    if original.shape != decoded.shape:
        raise ValueError(f"shapes differ: {tuple(original.shape)} vs {tuple(decoded.shape)}")
    if original.numel() == 0:
        return 0.0
    a = original.detach().cpu().to(torch.float64)
    b = decoded.detach().cpu().to(torch.float64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return float(torch.where(same, 0.0, (a - b).abs()).max())


def round_trip_error(tensor: torch.Tensor, compression: Compression | str) -> float:
    """Max abs error `compression` causes on `tensor` (0.0 for lossless codecs)."""
    return max_abs_error(tensor, decode_tensor(encode_tensor(tensor, compression)))


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality: same dtype, same shape, same bytes (nan payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(_uint8_view(a.detach().cpu()), _uint8_view(b.detach().cpu()))
