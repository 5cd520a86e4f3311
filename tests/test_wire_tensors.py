"""wire.tensors: every dtype, shape (0-d, empty, non-contiguous) and codec round-trips, lossless
codecs bit-exactly and lossy ones within their documented bound; bad maps raise MalformedTensor."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import wire
from wire import (
    CODECS,
    COMPRESSIONS,
    DTYPES,
    Compression,
    MalformedTensor,
    decode_tensor,
    encode_tensor,
    max_abs_error,
    round_trip_error,
    same_tensor,
)
from wire.packing import packb, unpack
from wire.tensors import INT8_BLOCK_SIZE

FLOATING = [dtype for dtype in DTYPES.values() if dtype.is_floating_point]
SPECIALS = [math.nan, math.inf, -math.inf, -0.0, 1e-40, -3e38]


def make_values(dtype: torch.dtype, count: int, seed: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(count, generator=generator, dtype=torch.float64) * scale).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (count,), generator=generator, dtype=torch.int64).to(
        dtype
    )


@st.composite
def tensors(draw: Any, dtypes: list[torch.dtype] | None = None, specials: bool = False) -> Any:
    dtype = draw(st.sampled_from(dtypes or list(DTYPES.values())))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    count = math.prod(shape)
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0, 1e3]))
    values = make_values(dtype, count, draw(st.integers(0, 2**32 - 1)), scale)
    if specials and dtype.is_floating_point and count:
        for _ in range(draw(st.integers(0, 3))):
            values[draw(st.integers(0, count - 1))] = draw(st.sampled_from(SPECIALS))
    tensor = values.reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "expanded"]))
    if layout == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, -1)
    elif layout == "strided" and tensor.dim() >= 1:
        tensor = torch.cat([tensor, tensor], dim=0)[::2]
    elif layout == "expanded":
        tensor = tensor.unsqueeze(-1).expand(*tensor.shape, 3)
    return tensor


def through_frame(encoded: dict[str, Any]) -> Any:
    """The encoded map as a peer receives it: msgpack bytes parsed by our decoder."""
    return unpack(packb(encoded))


@settings(max_examples=250, deadline=None)
@given(tensors(specials=True), st.booleans())
def test_raw_round_trips_bit_exactly(tensor: torch.Tensor, lz4: bool) -> None:
    encoded = encode_tensor(tensor, Compression("raw", lz4))
    decoded = decode_tensor(through_frame(encoded))
    assert same_tensor(decoded, tensor)
    assert decoded.is_contiguous()
    if decoded.numel():  # the result owns its memory: writing it leaves the source alone
        before = tensor.clone()
        decoded.view(-1)[0] = decoded.view(-1)[-1]
        assert same_tensor(tensor, before)


@settings(max_examples=150, deadline=None)
@given(
    tensors(dtypes=[torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]),
    st.sampled_from(COMPRESSIONS),
)
def test_lossy_codecs_fall_back_to_raw_on_integer_and_bool(tensor: torch.Tensor, name: str) -> None:
    encoded = encode_tensor(tensor, name)
    assert encoded["codec"] == "raw"
    assert same_tensor(decode_tensor(through_frame(encoded)), tensor)


def half_ulp_bound(original: torch.Tensor, mantissa_bits: int, smallest: float) -> torch.Tensor:
    """Round-to-nearest error bound of a float format with that many explicit mantissa bits."""
    magnitude = original.to(torch.float64).abs()
    return magnitude * 2.0 ** -(mantissa_bits + 1) + smallest / 2


def int8_bound(original: torch.Tensor) -> torch.Tensor:
    values = original.detach().reshape(-1).to(torch.float64)
    count = values.numel()
    blocks = -(-count // INT8_BLOCK_SIZE)
    padded = torch.nn.functional.pad(values, (0, blocks * INT8_BLOCK_SIZE - count))
    absmax = padded.view(blocks, INT8_BLOCK_SIZE).abs().amax(dim=1)
    per_value = absmax.repeat_interleave(INT8_BLOCK_SIZE)[:count] / 254
    # plus rounding the float32 result back into the tensor's own dtype
    relative = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}.get(original.dtype, 2.0**-22)
    return (per_value * (1 + 1e-5) + values.abs() * relative).reshape(original.shape)


@settings(max_examples=200, deadline=None)
@given(tensors(dtypes=FLOATING), st.sampled_from(CODECS[1:]), st.booleans())
def test_lossy_codecs_stay_within_their_bound(tensor: torch.Tensor, codec: str, lz4: bool) -> None:
    encoded = encode_tensor(tensor, Compression(codec, lz4))
    decoded = decode_tensor(through_frame(encoded))
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    if codec == "float16":
        bound = half_ulp_bound(tensor, 10, 2.0**-24)
    elif codec == "bfloat16":
        bound = half_ulp_bound(tensor, 7, 2.0**-133)
    else:
        bound = int8_bound(tensor)
    if tensor.dtype == torch.bfloat16 and codec == "float16":
        bound = bound + half_ulp_bound(tensor, 7, 2.0**-133)  # float16 -> bfloat16 on the way back
    error = (decoded.to(torch.float64) - tensor.to(torch.float64)).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    assert round_trip_error(tensor, encoded_name(codec, lz4)) == max_abs_error(tensor, decoded)


def encoded_name(codec: str, lz4: bool) -> str:
    return Compression(codec, lz4).name


@pytest.mark.parametrize("name", COMPRESSIONS)
def test_every_codec_reads_back_through_the_msgpack_library(name: str) -> None:
    """A second implementation using the msgpack library reads and writes the same maps."""
    tensor = torch.randn(3, 70)
    encoded = encode_tensor(tensor, name)
    via_library = msgpack.unpackb(msgpack.packb(encoded, use_bin_type=True), raw=False)
    assert same_tensor(decode_tensor(via_library), decode_tensor(through_frame(encoded)))
    assert packb(encoded) == msgpack.packb(encoded, use_bin_type=True)


def test_float16_halves_the_size_on_normal_data() -> None:
    tensor = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    raw, half = encode_tensor(tensor), encode_tensor(tensor, "float16")
    assert len(half["data"]) * 2 == len(raw["data"])
    decoded = decode_tensor(half)
    # Rounded to nearest: half an fp16 ulp, at most 2^-11 of each value (2^-25 below the normal
    # range), whatever the values' scale.
    bound = torch.clamp(tensor.abs() * 2.0**-11, min=2.0**-25)
    assert bool(((decoded - tensor).abs() <= bound).all())


def test_int8_blockwise_layout() -> None:
    """docs/wire.md: int8-blockwise of [0.5, -1.0, 0.25, 2.0] (one block, scale 2/127)."""
    encoded = encode_tensor(torch.tensor([0.5, -1.0, 0.25, 2.0]), "int8-blockwise")
    assert bytes(encoded["data"]) == bytes([32, 256 - 64, 16, 127])
    assert bytes(encoded["scales"]) == torch.tensor([2.0 / 127]).numpy().tobytes()
    assert packb(encoded).hex() == GOLDEN_INT8


def test_int8_blockwise_blocks_of_64_with_a_partial_last_block() -> None:
    values = torch.cat([torch.full((64,), 0.1), torch.full((10,), 100.0)])
    encoded = encode_tensor(values, "int8-blockwise")
    scales = torch.frombuffer(bytearray(encoded["scales"]), dtype=torch.float32)
    assert scales.tolist() == pytest.approx([0.1 / 127, 100.0 / 127])
    assert torch.allclose(decode_tensor(encoded), values, rtol=1e-6)
    zeros = decode_tensor(encode_tensor(torch.zeros(5), "int8-blockwise"))
    assert same_tensor(zeros, torch.zeros(5))


def test_int8_blockwise_refuses_non_finite_values() -> None:
    with pytest.raises(ValueError, match="inf or nan"):
        encode_tensor(torch.tensor([1.0, math.inf]), "int8-blockwise")


def test_encoder_refuses_what_has_no_wire_form() -> None:
    with pytest.raises(ValueError, match="no wire encoding"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        encode_tensor([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tensor codec"):
        encode_tensor(torch.zeros(2), "float8")


def test_compression_names() -> None:
    assert COMPRESSIONS == (
        "raw",
        "raw+lz4",
        "float16",
        "float16+lz4",
        "bfloat16",
        "bfloat16+lz4",
        "int8-blockwise",
        "int8-blockwise+lz4",
    )
    assert Compression.parse("lz4") == Compression("raw", True)
    assert Compression.parse("int8-blockwise+lz4").name == "int8-blockwise+lz4"
    with pytest.raises(ValueError, match="only '\\+lz4'"):
        Compression.parse("raw+zstd")


GOLDEN_RAW = (
    "85a56474797065a7666c6f61743332a57368617065920103a5636f646563a3726177a36c7a34c2a464617461c40c"
    "0000803f000000c00000003f"
)
GOLDEN_INT8 = (
    "86a56474797065a7666c6f61743332a573686170659104a5636f646563ae696e74382d626c6f636b77697365a36c"
    "7a34c2a67363616c6573c4040402813ca464617461c40420c0107f"
)


def test_golden_raw_tensor() -> None:
    """docs/wire.md: float32 [[1.0, -2.0, 0.5]], raw."""
    assert packb(encode_tensor(torch.tensor([[1.0, -2.0, 0.5]]))).hex() == GOLDEN_RAW
    decoded = decode_tensor(unpack(bytes.fromhex(GOLDEN_RAW)))
    assert same_tensor(decoded, torch.tensor([[1.0, -2.0, 0.5]]))


def valid() -> dict[str, Any]:
    return dict(encode_tensor(torch.tensor([[1.0, -2.0, 0.5]])), data=b"\0" * 12)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"dtype": "float8"}, "dtype 'float8' is not one of"),
        ({"dtype": 3}, "dtype 3 is not one of"),
        ({"dtype": None}, "is not one of"),
        ({"shape": "1x3"}, "shape must be a list"),
        ({"shape": [1, -3]}, "must hold sizes from 0"),
        ({"shape": [1, True]}, "must hold sizes from 0"),
        ({"shape": [1, 3.0]}, "must hold sizes from 0"),
        ({"shape": [1] * 17}, "17 dimensions"),
        ({"shape": [1 << 20, 1 << 20]}, "over the"),
        ({"shape": [0, 1 << 40]}, "must hold sizes from 0"),
        ({"codec": "float8"}, "codec 'float8' is not one of"),
        ({"codec": ["raw"]}, "is not one of"),
        ({"lz4": 1}, "lz4 must be true or false"),
        ({"data": "text"}, "data must be binary"),
        ({"data": b"\0" * 11}, "data is 11 bytes but its dtype, shape and codec need 12"),
        ({"data": b"\0\0"}, "need 12"),
        ({"lz4": True, "data": b"\xff\xff\xff"}, "not a valid lz4 block"),
        ({"lz4": True, "data": b"\x10\x41"}, "expands to 1 bytes"),
        ({"lz4": True, "shape": [1 << 20], "data": b"\0" * 10}, "cannot expand"),
        ({"dtype": "int32", "codec": "float16"}, "applies to floating tensors only"),
        ({"codec": "int8-blockwise"}, "scales is required"),
        ({"scales": b"\0\0\0\0"}, "only with it"),
        ({"codec": "int8-blockwise", "scales": b"\0", "data": b"\0" * 3}, "needs 4 bytes"),
        ({"codec": "int8-blockwise", "scales": 5, "data": b"\0" * 3}, "scales must be binary"),
        ({"dtype": "bool", "data": b"\0\2\0"}, "other than 0 and 1"),
    ],
)
def test_malformed_tensor_maps(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(MalformedTensor, match=reason):
        decode_tensor({**valid(), **change})


@pytest.mark.parametrize("missing", ["dtype", "shape", "codec", "data"])
def test_missing_fields(missing: str) -> None:
    value = valid()
    del value[missing]
    with pytest.raises(MalformedTensor):
        decode_tensor(value)


def test_not_a_map_and_the_size_limit() -> None:
    with pytest.raises(MalformedTensor, match="is a map"):
        decode_tensor([1, 2])
    with pytest.raises(MalformedTensor, match="over the 8-byte limit"):
        decode_tensor(valid(), max_bytes=8)


def test_unknown_keys_are_ignored_and_lz4_defaults_to_false() -> None:
    value = valid()
    del value["lz4"]
    value["future_field"] = [1, 2]
    assert decode_tensor(value).shape == (1, 3)


def test_public_names() -> None:
    assert wire.CODECS == ("raw", "float16", "bfloat16", "int8-blockwise")
    assert set(wire.DTYPES) >= {"float32", "float16", "bfloat16", "int64", "int32", "bool"}
