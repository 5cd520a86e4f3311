"""wire.framing: length-prefixed frames, decoded incrementally from any chunking, with the size
limit enforced from the 4 header bytes alone."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire import FrameDecoder, FrameTooLarge, MalformedFrame, decode_frame, encode_frame
from wire.framing import HEADER_SIZE

GOLDEN_FRAME = "0000000d81a568656c6c6fa5776f726c64"  # {"hello": "world"}


def test_golden_frame() -> None:
    """docs/wire.md: the frame carrying {"hello": "world"}."""
    assert bytes(encode_frame({"hello": "world"})).hex() == GOLDEN_FRAME
    assert decode_frame(bytes.fromhex(GOLDEN_FRAME)) == {"hello": "world"}


def frames_of(count: int) -> list[dict[str, object]]:
    return [
        {"n": index, "pad": "x" * (index * 37 % 300), "b": bytes(index % 7)}
        for index in range(count)
    ]


def plain(frame: dict[str, object]) -> dict[str, object]:
    return {
        key: bytes(value) if isinstance(value, memoryview) else value
        for key, value in frame.items()
    }


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(1, 400), min_size=1, max_size=40), st.booleans())
def test_any_chunking_gives_the_same_frames(
    count: int, cuts: list[int], as_bytearray: bool
) -> None:
    frames = frames_of(count)
    stream = b"".join(bytes(encode_frame(frame)) for frame in frames)
    decoder = FrameDecoder()
    received = []
    pos = 0
    for cut in cuts * (len(stream) // max(sum(cuts), 1) + 1):
        chunk = stream[pos : pos + cut]
        pos += cut
        if not chunk:
            break
        buffer = bytearray(chunk) if as_bytearray else chunk
        decoder.receive_data(buffer)
        if as_bytearray:
            buffer[:] = b"\xff" * len(buffer)  # the decoder must have copied what it keeps
        received.extend(plain(frame) for frame in decoder)
    decoder.receive_data(b"")
    assert decoder.next_frame() is None
    assert received == frames


def test_one_byte_at_a_time_and_several_frames_in_one_chunk() -> None:
    frames = frames_of(5)
    stream = b"".join(bytes(encode_frame(frame)) for frame in frames)
    one = FrameDecoder()
    got = []
    for index in range(len(stream)):
        one.receive_data(stream[index : index + 1])
        got.extend(plain(frame) for frame in one)
    assert got == frames
    whole = FrameDecoder()
    whole.receive_data(stream)
    assert [plain(frame) for frame in whole] == frames


def test_header_over_the_limit_is_refused_before_allocating() -> None:
    decoder = FrameDecoder(max_frame_size=1 << 20)
    tracemalloc.start()
    try:
        decoder.receive_data(b"\xff\xff\xff\xff")  # 4 GiB, the most a header can claim
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10
    with pytest.raises(FrameTooLarge, match="4294967295-byte frame, over the 1048576-byte limit"):
        decoder.next_frame()


def test_frame_limit_boundary() -> None:
    frame = encode_frame({"a": b"x" * 100})
    size = len(frame) - HEADER_SIZE
    assert decode_frame(frame, max_frame_size=size) == {"a": memoryview(b"x" * 100)}
    with pytest.raises(FrameTooLarge):
        decode_frame(frame, max_frame_size=size - 1)
    with pytest.raises(FrameTooLarge, match="smaller steps"):
        encode_frame({"a": b"x" * 100}, max_frame_size=size - 1)


def test_errors_are_sticky_and_come_after_good_frames() -> None:
    good = bytes(encode_frame({"ok": True}))
    decoder = FrameDecoder(max_frame_size=1000)
    decoder.receive_data(good + b"\x00\x00\x10\x00" + good)
    assert decoder.next_frame() == {"ok": True}
    for _ in range(2):
        with pytest.raises(FrameTooLarge):
            decoder.next_frame()
    decoder.receive_data(good)  # ignored: the stream can no longer be trusted
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (b"\x00\x00", "got 2 of its 4 bytes"),
        (b"\x00\x00\x00\x05\x81", "got 5 of its 9 bytes"),
        (b"\x00\x00\x00\x00", "length 0"),
        (b"\x00\x00\x00\x01\x01", "carries a int"),
        (b"\x00\x00\x00\x02\x81\xa1", "map of 1 entries at offset 1 claims 2 bytes"),
    ],
)
def test_malformed_streams(stream: bytes, reason: str) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(stream)
    decoder.receive_data(b"")
    with pytest.raises(MalformedFrame, match=reason):
        decoder.next_frame()


def test_clean_end_of_stream_and_misuse() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame({}))
    decoder.receive_data(b"")
    assert decoder.ended
    assert decoder.next_frame() == {}
    assert decoder.next_frame() is None
    decoder.receive_data(b"")  # saying it twice is fine
    with pytest.raises(RuntimeError, match="after the end"):
        decoder.receive_data(b"x")
    with pytest.raises(MalformedFrame, match="several"):
        decode_frame(bytes(encode_frame({})) * 2)
    with pytest.raises(MalformedFrame, match="empty stream"):
        decode_frame(b"")
    with pytest.raises(TypeError, match="carries a map"):
        encode_frame([1, 2])  # type: ignore[arg-type]


def test_immutable_input_is_not_copied_and_mutable_input_is() -> None:
    payload = {"data": b"\x07" * 2_000_000}
    frame = encode_frame(payload)  # large: a frozen numpy buffer
    decoder = FrameDecoder()
    decoder.receive_data(frame)
    assert decoder.next_frame()["data"].obj is frame.obj  # a view of the frame itself
    mutable = bytearray(frame)
    decoder.receive_data(mutable)
    value = decoder.next_frame()["data"]
    assert value.obj is not mutable and bytes(value[:3]) == b"\x07\x07\x07"


def test_buffered_bytes() -> None:
    decoder = FrameDecoder()
    frame = bytes(encode_frame({"a": 1}))
    decoder.receive_data(frame[:-1])
    assert decoder.buffered_bytes == len(frame) - 1
    decoder.receive_data(frame[-1:])
    assert decoder.buffered_bytes == len(frame)
    decoder.next_frame()
    assert decoder.buffered_bytes == 0
