"""Hostile inputs against the wire decoders and a real in-process server (tests/memnet.py): empty
tensors, nan and inf, frames built to make the decoder allocate or spin, and errors that would keep
what was decoded alive (docs/wire.md#limits-per-frame; the security review's findings 1, 3, 4, 11).

Bounds are measured with tracemalloc (Python and numpy allocations), never with a clock."""

from __future__ import annotations

import gc
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from libp2p.peer.id import ID

import blocks
import wire
from peerd.node.p2p import INFERENCE_PROTOCOL, INFO_PROTOCOL, TRAINING_PROTOCOL
from peerd.node.streams import MessageStream, PeerGone
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, open_memnet
from wire.framing import encode_frame
from wire.packing import packb

HIDDEN = 32
TIMEOUT_S = 30.0  # generous: a loaded CI machine; nothing here waits for a deadline to pass
MiB = 1 << 20


# --- frames no honest encoder writes ----------------------------------------------------------


def _frame(envelope: dict[str, Any]) -> bytes:
    return bytes(encode_frame(envelope))


def _with_tensor(message: wire.Message, field: str, tensor: torch.Tensor) -> bytes:
    """The frame of `message` with its tensor `field` replaced by `tensor`, as a peer that skips
    validation would send it."""
    envelope = wire.to_envelope(message)
    envelope["body"][field] = wire.encode_tensor(tensor)
    if field == "hidden_states" and "grad_outputs" in envelope["body"]:
        envelope["body"]["grad_outputs"] = wire.encode_tensor(tensor)
    return _frame(envelope)


def _raw_frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def _empty_maps(count: int) -> bytes:
    """About `count` empty maps (one byte each on the wire, a dict each when decoded), in arrays
    of 2^17 (the most items one array may have) inside one array."""
    inner = 1 << 17
    array = b"\xdd" + inner.to_bytes(4, "big") + b"\x80" * inner
    outer = count // inner
    return b"\xdd" + outer.to_bytes(4, "big") + array * outer


def _envelope_head(tag: str) -> bytes:
    return b"\x83" + packb("protocol") + packb(1) + packb("type") + packb(tag) + packb("body")


@contextmanager
def _traced() -> Iterator[Callable[[], tuple[int, int]]]:
    """(current, peak) bytes allocated since entering, the garbage collector off: memory that
    only a collection would free (a reference cycle) counts as kept."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield lambda: tuple(size - base for size in tracemalloc.get_traced_memory())  # type: ignore[return-value]
    finally:
        tracemalloc.stop()
        gc.enable()


# --- the decoders alone -------------------------------------------------------------------------


FRAME_16_MIB = 16 * MiB


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_envelope_head("info_request") + _empty_maps(FRAME_16_MIB), id="info"),
        pytest.param(_envelope_head("step") + _empty_maps(FRAME_16_MIB), id="step"),
        pytest.param(
            b"\x83" + packb("body") + _empty_maps(FRAME_16_MIB) + packb("protocol") + b"\x01",
            id="body-first",
        ),
        pytest.param(
            b"\x82" + packb("protocol") + b"\x01" + packb("x") + _empty_maps(FRAME_16_MIB),
            id="extra-key",
        ),
        pytest.param(_empty_maps(FRAME_16_MIB), id="not-an-envelope"),
    ],
)
def test_a_16_mib_frame_of_empty_maps_is_refused_with_bounded_allocations(body: bytes) -> None:
    frame = _raw_frame(body)
    decoder = wire.MessageDecoder()
    with _traced() as used:
        decoder.receive_data(frame)
        with pytest.raises(wire.ProtocolError):
            decoder.next_message()
        current, peak = used()
    # Decoding it all would make 16 million dicts (over 1 GiB); the type's budget stops the
    # body after at most tens of thousands of values.
    assert peak < 4 * MiB, peak
    assert current < 64 << 10, current


def test_an_info_request_frame_over_its_type_limit_is_refused_before_it_is_allocated() -> None:
    decoder = wire.MessageDecoder(expect=wire.InfoRequest)
    with _traced() as used:
        decoder.receive_data((64 * MiB).to_bytes(4, "big"))  # a length, then a stall
        with pytest.raises(wire.FrameTooLarge, match="over the 4096-byte limit"):
            decoder.next_message()
        assert used()[1] < 64 << 10
    # Without `expect`, the type is still checked before the body is read.
    frame = _raw_frame(_envelope_head("info_request") + packb({"pad": "x" * 8192}))
    with pytest.raises(wire.MalformedMessage, match=r"info_request: frame of .* over the 4096"):
        wire.decode_message(frame)


def test_lz4_cannot_inflate_the_tensors_of_one_message_past_the_frame_limit() -> None:
    """Three lz4 tensors of 8 MiB each in a frame of ~100 KiB, against a 12 MiB limit: each is
    under it, two are not; refused before the second is decompressed."""
    huge = torch.zeros(1, 2 * MiB, 1)  # 8 MiB of float32 zeros: lz4 packs it ~250x
    backward = wire.Backward(
        model="m",
        start=0,
        end=1,
        hidden_states=torch.ones(1, 1, 1),
        grad_outputs=torch.ones(1, 1, 1),
    )
    envelope = wire.to_envelope(backward)
    for field in ("hidden_states", "grad_outputs"):
        envelope["body"][field] = wire.encode_tensor(huge, "lz4")
    envelope["body"]["prompts"] = wire.encode_tensor(torch.zeros(1, 1, 2 * MiB, 1), "lz4")
    frame = _frame(envelope)
    assert len(frame) < MiB
    with _traced() as used:
        with pytest.raises(wire.MalformedTensor, match=r"grad_outputs: .*share the frame limit"):
            wire.decode_message(frame, max_frame_size=12 * MiB)
        peak = used()[1]
    # One tensor: 8 MiB, and 8 more that lz4 allocates while decompressing it; three: over 24.
    assert peak < 20 * MiB, peak


def test_the_message_type_is_checked_before_its_tensors_are_decoded() -> None:
    step = wire.Step(session_id="s", step_id=0, hidden_states=torch.ones(1, 1024, 1024))
    frame = bytes(wire.encode_message(step, "lz4"))
    with _traced() as used:
        with pytest.raises(wire.UnexpectedMessage):
            wire.decode_message(frame, expect=wire.InfoRequest)
        assert used()[1] < MiB  # the 4 MiB tensor was never decompressed


def test_a_failed_decode_keeps_nothing_it_decoded_alive() -> None:
    """A step whose 8 MiB of hidden states decode before a later field is refused, fed in
    chunks (so the decoder owns a copy of the frame): with the garbage collector off, neither
    the tensor nor the frame outlives the error, while the decoder (a stream still open) lives
    on."""
    step = wire.Step(session_id="s", step_id=0, hidden_states=torch.randn(1, 2048, 1024))
    envelope = wire.to_envelope(step)
    envelope["body"]["start_position"] = -1
    frame = _frame(envelope)
    decoders = []
    with _traced() as used:
        for _ in range(3):
            decoder = wire.MessageDecoder()
            for at in range(0, len(frame), MiB):
                decoder.receive_data(frame[at : at + MiB])
            with pytest.raises(wire.MalformedMessage, match="start_position"):
                decoder.next_message()
            with pytest.raises(wire.MalformedMessage, match="start_position"):
                decoder.next_message()  # the stream stays failed
            decoders.append(decoder)
        current = used()[0]
    assert current < MiB, current  # before: 3 x (8 MiB frame + 8 MiB tensor) kept


# --- messages: empty and non-finite tensors ---------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 0, 4), (0, 2, 4), (1, 2, 0)])
def test_an_empty_tensor_is_refused_on_both_sides(shape: tuple[int, ...]) -> None:
    empty = torch.zeros(shape)
    with pytest.raises(wire.MalformedMessage, match="every dimension must be at least 1"):
        wire.Step(session_id="s", step_id=0, hidden_states=empty)
    frame = _with_tensor(
        wire.Step(session_id="s", step_id=0, hidden_states=torch.ones(1, 1, 4)),
        "hidden_states",
        empty,
    )
    with pytest.raises(wire.MalformedMessage, match=r"step.hidden_states: has shape"):
        wire.decode_message(frame)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_a_non_finite_value_anywhere_in_any_view_is_refused(dtype: torch.dtype, grad: bool) -> None:
    base = torch.ones(2, 6, 8, dtype=dtype)
    base[1, 4, 6] = float("nan")
    view = base.transpose(0, 1)[:, :, 2:].requires_grad_(grad)  # not contiguous, nan kept
    with pytest.raises(wire.NonFiniteTensor, match="nan or inf"):
        wire.StepResult(session_id="s", step_id=0, hidden_states=view)
    finite = base.nan_to_num().transpose(0, 1)[:, :, 2:].requires_grad_(grad)
    wire.StepResult(session_id="s", step_id=0, hidden_states=finite)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_tensor_is_refused_on_both_sides(value: float) -> None:
    bad = torch.ones(1, 3, 4)
    bad[0, 1, 2] = value
    with pytest.raises(wire.NonFiniteTensor, match="nan or inf"):
        wire.StepResult(session_id="s", step_id=0, hidden_states=bad)
    for compression in ("raw", "float16", "bfloat16+lz4"):
        frame = bytes(
            wire.encode_frame(
                {
                    "protocol": 1,
                    "type": "step_result",
                    "body": {
                        "session_id": "s",
                        "step_id": 0,
                        "hidden_states": wire.encode_tensor(bad, compression),
                    },
                }
            )
        )
        with pytest.raises(wire.MalformedTensor, match=r"step_result\.hidden_states: holds nan"):
            wire.decode_message(frame)


# --- a real server -------------------------------------------------------------------------------


@pytest.fixture
async def net(tiny_llama: Path) -> AsyncIterator[MemNet]:
    async with open_memnet() as net:
        net.serve("a", blocks.load_span(tiny_llama, 0, TINY_BLOCKS))
        yield net


async def _stream(net: MemNet, protocol: str) -> MessageStream:
    raw = await net.node("client").open_stream(ID.from_base58(net.peer_id("a")), protocol)
    return MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)


async def _session(net: MemNet) -> tuple[MessageStream, str]:
    stream = await _stream(net, INFERENCE_PROTOCOL)
    session_id = uuid.uuid4().hex
    await stream.send(
        wire.OpenSession(
            session_id=session_id, model=TINY_MODEL, start=0, end=TINY_BLOCKS, max_length=64
        )
    )
    assert isinstance(await stream.receive(TIMEOUT_S), wire.SessionOpened)
    return stream, session_id


async def _refused(stream: MessageStream, frame: bytes) -> wire.Error:
    await stream.stream.write(frame)
    reply = await stream.receive(TIMEOUT_S)
    assert isinstance(reply, wire.Error), reply
    return reply


def _forward(hidden: torch.Tensor) -> wire.Forward:
    return wire.Forward(model=TINY_MODEL, start=0, end=TINY_BLOCKS, hidden_states=hidden)


def _backward(hidden: torch.Tensor) -> wire.Backward:
    return wire.Backward(
        model=TINY_MODEL, start=0, end=TINY_BLOCKS, hidden_states=hidden, grad_outputs=hidden
    )


async def _still_serves(net: MemNet) -> None:
    stream, session_id = await _session(net)
    await stream.send(
        wire.Step(session_id=session_id, step_id=0, hidden_states=torch.randn(1, 2, HIDDEN))
    )
    assert isinstance(await stream.receive(TIMEOUT_S), wire.StepResult)


@pytest.mark.parametrize(
    "what, tensor",
    [
        ("step", torch.zeros(1, 0, HIDDEN)),
        ("forward", torch.zeros(0, 2, HIDDEN)),
        ("backward", torch.zeros(1, 0, HIDDEN)),
        ("step", torch.full((1, 2, HIDDEN), float("nan"))),
        ("forward", torch.full((1, 2, HIDDEN), float("inf"))),
        ("backward", torch.full((1, 2, HIDDEN), float("-inf"))),
    ],
)
async def test_empty_or_non_finite_inputs_get_bad_request_and_the_server_serves_on(
    net: MemNet, what: str, tensor: torch.Tensor
) -> None:
    ones = torch.ones(1, 1, HIDDEN)
    if what == "step":
        stream, session_id = await _session(net)
        frame = _with_tensor(
            wire.Step(session_id=session_id, step_id=0, hidden_states=ones), "hidden_states", tensor
        )
    else:
        stream = await _stream(net, TRAINING_PROTOCOL)
        request = _forward(ones) if what == "forward" else _backward(ones)
        frame = _with_tensor(request, "hidden_states", tensor)
    reply = await _refused(stream, frame)
    assert reply.code == wire.ErrorCode.BAD_REQUEST, reply
    assert "every dimension must be at least 1" in reply.message or "nan or inf" in reply.message
    assert wire.ErrorCode.INTERNAL not in net.server("a").counters.errors
    await _still_serves(net)


async def test_a_server_whose_blocks_produce_nan_answers_an_error_not_the_values(
    tiny_llama: Path,
) -> None:
    """A span with a broken weight (as faulty memory or a bad download would leave it) turns
    finite inputs into nan: the server answers an error, not the values."""
    span = blocks.load_span(tiny_llama, 0, TINY_BLOCKS)
    with torch.no_grad():
        for weight in span.parameters():
            weight.fill_(float("nan"))
    async with open_memnet() as net:
        net.serve("a", span)
        stream, session_id = await _session(net)
        training = await _stream(net, TRAINING_PROTOCOL)
        await stream.send(
            wire.Step(session_id=session_id, step_id=0, hidden_states=torch.randn(1, 2, HIDDEN))
        )
        step_reply = await stream.receive(TIMEOUT_S)
        await training.send(_forward(torch.randn(1, 2, HIDDEN)))
        forward_reply = await training.receive(TIMEOUT_S)
        for reply in (step_reply, forward_reply):
            assert isinstance(reply, wire.Error), reply
            assert reply.code == wire.ErrorCode.INTERNAL and "nan or inf" in reply.message
        info = await _stream(net, INFO_PROTOCOL)  # and it serves on
        await info.send(wire.InfoRequest())
        assert isinstance(await info.receive(TIMEOUT_S), wire.InfoResponse)


@pytest.mark.parametrize(
    ("protocol", "limit"), [(INFO_PROTOCOL, "4096"), (INFERENCE_PROTOCOL, str(MiB))]
)
async def test_an_oversized_first_request_is_refused_at_its_length(
    net: MemNet, protocol: str, limit: str
) -> None:
    """An info request needs a few KiB, an open_session at most 1 MiB: a peer announcing 200 MiB
    is refused by the length prefix alone (the server never waits for, nor allocates, the body)."""
    stream = await _stream(net, protocol)
    await stream.stream.write((200 * MiB).to_bytes(4, "big"))
    reply = await stream.receive(TIMEOUT_S)
    assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BAD_REQUEST
    assert f"over the {limit}-byte limit" in reply.message
    with pytest.raises(PeerGone):
        await stream.receive(TIMEOUT_S)


def test_a_receivers_shape_rule_refuses_a_tensor_before_its_data_is_decompressed() -> None:
    step = wire.Step(session_id="s", step_id=0, hidden_states=torch.zeros(1, 4096, 1024))
    frame = bytes(wire.encode_message(step, "lz4"))  # 16 MiB of zeros in ~64 KiB
    seen = []

    def only_32_wide(path: str, shape: list[int]) -> None:
        seen.append(path)
        if shape[-1] != 32:
            raise ValueError("must be 32 wide")

    with _traced() as used:
        with pytest.raises(wire.MalformedTensor, match=r"step\.hidden_states: must be 32 wide"):
            wire.decode_message(frame, check_tensor=only_32_wide)
        assert used()[1] < MiB
    assert seen == ["step.hidden_states"]


async def test_a_server_refuses_a_too_wide_step_before_decompressing_it(net: MemNet) -> None:
    stream, session_id = await _session(net)
    wide = wire.Step(session_id=session_id, step_id=0, hidden_states=torch.zeros(1, 4096, 1024))
    frame = bytes(wire.encode_message(wide, "lz4"))  # 16 MiB once decompressed
    with _traced() as used:
        reply = await _refused(stream, frame)
        peak = used()[1]
    assert reply.code == wire.ErrorCode.BAD_REQUEST and f"must be {HIDDEN} wide" in reply.message
    assert peak < 8 * MiB, peak
    await _still_serves(net)
