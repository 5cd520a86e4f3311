"""Structure-aware fuzzing (hypothesis) of every decoder that faces the network or the socket,
beside the byte-level fuzz of tests/test_wire_fuzz.py:

- every peer-protocol and local-API message type, its body built from its own schema (near-
  valid values at the limits, wrong types, missing and unknown keys, tensors of every dtype and
  codec with broken shapes): decoding gives that message (which re-encodes to the same frame)
  or a ProtocolError, never anything else; the frame decoder agrees byte for byte;
- the server record a peer answers to `info` (ServerInfo -> routing's ServerRecord), which the
  swarm view turns into routes: a record or ValueError;
- the local API's socket, a real LocalApi on a Unix socket: mutated frames before and after the
  Hello handshake get an `error` or a hang-up, and the API keeps serving a good client.

Reproducible (derandomized); the counts are printed with -s.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wire
from peerd.daemon.local_api import ApiError, LocalApi
from routing.records import info_to_record
from tests.test_wire_fuzz import BYTE_MUTATIONS, CORPUS
from wire import ProtocolError, decode_message, encode_message, message_types
from wire.fields import WireField
from wire.packing import packb

MAX_FRAME = 64 << 10
EXAMPLES_PER_TYPE = 50
SOCKET_CASES = 1500

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_TYPE,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_INT_EDGES = [0, 1, -1, 2, 63, 64, 255, 256, 4095, 4096, 8192, (1 << 20), (1 << 20) + 1]
_INT_EDGES += [(1 << 31) - 1, 1 << 31, (1 << 40), (1 << 40) + 1, (1 << 63) - 1, -(1 << 63)]

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=16),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-5, 5), max_size=2),
)


def _near(limit: float | None) -> list[int]:
    if limit is None or not math.isfinite(limit):
        return []
    n = int(limit)
    return [n - 1, n, n + 1]


def _ints(field: WireField, clean: bool) -> st.SearchStrategy[int]:
    rule = field.rule
    if clean:  # inside the field's bounds, edges included
        low = max(
            v
            for v in (rule.ge, None if rule.gt is None else rule.gt + 1, -(1 << 63))
            if v is not None
        )
        high = min(
            v
            for v in (rule.le, None if rule.lt is None else rule.lt - 1, (1 << 63) - 1)
            if v is not None
        )
        return st.one_of(st.sampled_from([int(low), int(high)]), st.integers(int(low), int(high)))
    edges = _INT_EDGES + _near(rule.ge) + _near(rule.gt) + _near(rule.le) + _near(rule.lt)
    edges = [e for e in edges if -(1 << 63) <= e < (1 << 64)]
    return st.one_of(st.sampled_from(edges), st.integers(-(1 << 63), (1 << 64) - 1))


def _texts(field: WireField, clean: bool) -> st.SearchStrategy[str]:
    rule = field.rule
    longest = rule.max_len if rule.max_len is not None and rule.max_len < 300 else 300
    if clean:
        shortest = rule.min_len or 0
        return st.text(min_size=shortest, max_size=min(longest, 40))
    at_limit = st.integers(max(longest - 1, 0), longest + 1).map(lambda n: "x" * n)
    return st.one_of(st.text(max_size=12), at_limit, st.just(""))


@st.composite
def _tensor_maps(draw: st.DrawFn, field: WireField, clean: bool) -> dict[str, Any]:
    """An encoded tensor of any dtype and codec (of the field's kind when clean), else perhaps
    broken in one place."""
    names = sorted(wire.DTYPES)
    if clean and field.rule.floating:
        names = [n for n in names if wire.DTYPES[n].is_floating_point]
    dtype = wire.DTYPES[draw(st.sampled_from(names))]
    ndim = field.rule.ndim if clean and field.rule.ndim is not None else None
    shape = draw(st.lists(st.integers(0, 5), min_size=ndim or 0, max_size=ndim or 4))
    values = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) - 3
    tensor = values.to(dtype)
    codec = "raw"
    if dtype.is_floating_point:
        codec = draw(st.sampled_from(sorted(wire.COMPRESSIONS)))
    encoded = dict(wire.encode_tensor(tensor, codec))
    encoded = {key: bytes(v) if isinstance(v, memoryview) else v for key, v in encoded.items()}
    if not clean and draw(st.booleans()):
        key = draw(st.sampled_from([*sorted(encoded), "extra"]))
        encoded[key] = draw(
            st.one_of(
                junk,
                st.lists(st.integers(-2, 1 << 32), max_size=5),
                st.sampled_from([*wire.DTYPES, *wire.CODECS, "raw+lz4"]),
            )
        )
    return encoded


def _values(field: WireField, clean: bool) -> st.SearchStrategy[Any]:
    kind = field.kind
    if kind == "int":
        valid: st.SearchStrategy[Any] = _ints(field, clean)
    elif kind == "float":
        low = field.rule.ge if field.rule.ge is not None else field.rule.gt
        valid = st.one_of(
            st.floats(allow_nan=not clean, allow_infinity=not clean),
            st.sampled_from([0.0, -0.0, 1.0, 1e-40, 100.0, 100.5, 3600.0, 3601.0]),
        )
        if clean:
            high = field.rule.le if field.rule.le is not None else field.rule.lt
            valid = st.floats(
                min_value=low,
                max_value=high,
                exclude_min=field.rule.gt is not None,
                exclude_max=field.rule.lt is not None,
                allow_nan=False,
                allow_infinity=False,
            )
    elif kind == "bool":
        valid = st.booleans()
    elif kind == "str":
        valid = _texts(field, clean)
    elif kind == "bytes":
        valid = st.binary(max_size=64)
    elif kind == "literal":
        valid = st.sampled_from(field.choices)
        if not clean:
            valid = st.one_of(valid, st.text(max_size=6))
    elif kind == "tensor":
        valid = _tensor_maps(field, clean)
    elif kind == "record":
        assert field.record is not None
        valid = _bodies(field.record._wire_fields, clean)
    else:
        assert kind == "tuple" and field.item is not None
        most = field.rule.max_items if field.rule.max_items is not None else 64
        least = field.rule.min_items or 0
        extra = 0 if clean else 1
        valid = st.lists(
            _values(field.item, clean),
            min_size=least if clean else 0,
            max_size=max(least, min(most, 3)) + extra,
        )
    if field.optional:
        valid = st.one_of(st.none(), valid)
    return valid if clean else st.one_of(valid, valid, valid, junk)


def _bodies(fields: tuple[WireField, ...], clean: bool) -> st.SearchStrategy[dict[str, Any]]:
    """A message body: every field in range (`clean`), or near-valid with junk, gaps and
    unknown keys."""
    strategies = {field.name: _values(field, clean) for field in fields}
    complete = st.fixed_dictionaries(strategies)
    if clean:
        return complete
    partial = st.fixed_dictionaries({}, optional=strategies)
    extra = st.dictionaries(st.sampled_from(["zzz", "future_field", ""]), junk, max_size=1)
    return st.builds(lambda body, more: {**more, **body}, st.one_of(complete, partial), extra)


def _any_bodies(fields: tuple[WireField, ...]) -> st.SearchStrategy[Any]:
    clean, dirty = _bodies(fields, True), _bodies(fields, False)
    return st.one_of(clean, clean, dirty, dirty, junk)


def _mostly(value: Any, *others: Any) -> st.SearchStrategy[Any]:
    """`value` four times in five, else one of `others`."""
    return st.one_of(*[st.just(value)] * 4, st.sampled_from(others))


def _envelopes(tag: str) -> st.SearchStrategy[dict[str, Any]]:
    cls = message_types()[tag]
    return st.fixed_dictionaries(
        {
            "protocol": _mostly(wire.PROTOCOL_VERSION, 0, 2, "1"),
            "type": _mostly(tag, "", "x", "step"),
            "body": _any_bodies(cls._wire_fields),
        }
    )


def _frame(envelope: dict[str, Any]) -> bytes:
    """The frame of `envelope`, its keys in the order encoders write them (a receiver refuses a
    body that comes before protocol and type: tests/test_hostile_inputs.py)."""
    order = ["protocol", "type", "body"]
    envelope = {key: envelope[key] for key in sorted(envelope, key=order.index)}
    body = packb(envelope)
    return len(body).to_bytes(4, "big") + body


OUTCOMES: Counter[str] = Counter()


@pytest.mark.parametrize("tag", sorted(message_types()))
@FUZZ_SETTINGS
@given(data=st.data())
def test_every_message_decodes_from_its_schema_or_raises_protocol_error(
    tag: str, data: st.DataObject
) -> None:
    envelope = data.draw(_envelopes(tag))
    try:
        message = decode_message(envelope, max_frame_size=MAX_FRAME)
    except ProtocolError:
        OUTCOMES["refused"] += 1
        message = None
    frames = wire.MessageDecoder(max_frame_size=MAX_FRAME)
    frames.receive_data(_frame(envelope))
    try:
        from_bytes = frames.next_message()
    except ProtocolError:
        from_bytes = None
    if message is None:
        assert from_bytes is None
        return
    OUTCOMES["accepted"] += 1
    assert type(message) is message_types()[tag]
    assert from_bytes is not None
    frame = bytes(encode_message(message))
    assert bytes(encode_message(from_bytes)) == frame
    assert bytes(encode_message(decode_message(frame))) == frame


@settings(FUZZ_SETTINGS, max_examples=400)
@given(body=_any_bodies(wire.ServerInfo._wire_fields))
def test_a_peers_server_record_becomes_a_route_record_or_value_error(body: dict[str, Any]) -> None:
    envelope = {"protocol": wire.PROTOCOL_VERSION, "type": "info_response", "body": {}}
    envelope["body"] = {"record": body}
    try:
        reply = decode_message(envelope, max_frame_size=MAX_FRAME, expect=wire.InfoResponse)
    except ProtocolError:
        OUTCOMES["record refused by the wire"] += 1
        return
    try:
        record = info_to_record(reply.record)
    except ValueError:
        OUTCOMES["record refused by routing"] += 1
        return
    OUTCOMES["record accepted"] += 1
    assert (record.peer_id, record.start, record.end) == (
        reply.record.peer_id,
        reply.record.start,
        reply.record.end,
    )


# --- the local API socket -------------------------------------------------------------


def _welcome() -> wire.Welcome:
    return wire.Welcome(
        version="0.1.0", peer_id="12D3KooWA", model="m", num_blocks=30, hidden_size=8
    )


def _status() -> wire.StatusResponse:
    return wire.StatusResponse(peer_id="12D3KooWA", version="0.1.0", uptime_s=1.0)


async def _no_model() -> Any:
    # This API fronts no model: generation requests get a typed refusal, which is what the
    # fuzz checks they get instead of a crash.
    raise ApiError("unavailable", "this test daemon has no model loaded")


async def _exchange(path: Path, data: bytes) -> list[wire.Message]:
    """Send `data` on a fresh connection, half-close, and read what comes back until EOF."""
    stream = await trio.open_unix_socket(str(path))
    replies: list[wire.Message] = []
    decoder = wire.MessageDecoder()
    async with stream:
        try:
            await stream.send_all(data)
            await stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the API hung up on garbage before reading it all: fine
        with trio.fail_after(10):
            while chunk := await _receive(stream):
                decoder.receive_data(chunk)
                replies.extend(decoder)
    return replies


async def _receive(stream: trio.SocketStream) -> bytes:
    try:
        return await stream.receive_some(1 << 16)
    except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionResetError):
        return b""


async def test_the_local_api_answers_mutated_frames_with_errors_and_keeps_serving(
    tmp_path: Path,
) -> None:
    rng = random.Random(20251130)
    api = LocalApi(
        socket_path=tmp_path / "peerd.sock",
        get_generator=_no_model,
        status=_status,
        welcome=_welcome,
    )
    hello = bytes(encode_message(wire.Hello(client="fuzz")))
    kinds: Counter[str] = Counter()
    async with trio.open_nursery() as nursery:
        path = await nursery.start(api.serve)
        for _ in range(SOCKET_CASES):
            mutation = rng.choice(BYTE_MUTATIONS)
            data = bytes(mutation(rng, bytearray(rng.choice(CORPUS))))
            if rng.random() < 0.5:
                data = hello + data  # after the handshake
            replies = await _exchange(path, data)
            for reply in replies:
                assert isinstance(reply, wire.Welcome | wire.StatusResponse | wire.Error), reply
                kinds[type(reply).__name__] += 1
        # A good client is still served after all of it.
        replies = await _exchange(path, hello + bytes(encode_message(wire.StatusRequest())))
        assert [type(r) for r in replies] == [wire.Welcome, wire.StatusResponse]
        assert api.connections == 0
        nursery.cancel_scope.cancel()
    print(f"{SOCKET_CASES} connections with mutated frames; replies: {dict(kinds)}")
    assert kinds["Error"] > SOCKET_CASES // 4


def test_zz_fuzz_counts() -> None:
    """Prints what the schema fuzz did (run with -s); fails if it never accepted or refused."""
    print(f"schema fuzz outcomes: {dict(OUTCOMES)}")
    if OUTCOMES:  # empty when this test runs alone (-k)
        assert OUTCOMES["accepted"] > 0 and OUTCOMES["refused"] > 0
