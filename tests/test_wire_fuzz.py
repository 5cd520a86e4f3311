"""Fuzz the decoders: 100,000 random and mutated frames, msgpack objects and tensor maps (fixed
seed, reproducible) must produce valid messages or ProtocolError, nothing else, quickly, and
without memory beyond the frame limit.

A failure prints the case number and mutation; rerun one case with `fuzz_case(SEED, number)`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import resource
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import wire
from tests.test_wire_messages import EXAMPLES
from wire import MessageDecoder, ProtocolError, decode_message, decode_tensor, encode_message
from wire.packing import packb, unpack

SEED = 20250601
CASES = 100_000
MAX_FRAME = 64 << 10
"""Frame (and so tensor) limit the fuzzed decoders run with: memory per case stays near this."""

INTERESTING_INTS = [0, 1, -1, 2, 63, 64, 65, 127, 128, 255, 256, 4096, 65535, 65536]
INTERESTING_INTS += [
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    (1 << 63) - 1,
    -(1 << 63),
    (1 << 64) - 1,
]
INTERESTING_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-40, 1e300, math.inf, -math.inf, math.nan]
INTERESTING_BYTES = [0x00, 0x7F, 0x80, 0x8F, 0x9F, 0xBF, 0xC0, 0xC1, 0xC4, 0xC6, 0xCF, 0xD4]
INTERESTING_BYTES += [0xD9, 0xDB, 0xDD, 0xDF, 0xE0, 0xFF]


def _names() -> list[str]:
    names = {"protocol", "type", "body", "dtype", "shape", "codec", "lz4", "data", "scales"}
    names |= set(wire.message_types()) | set(wire.DTYPES) | set(wire.CODECS)
    for cls in [*wire.message_types().values(), wire.ServerInfo, wire.NextHop]:
        names |= {field.name for field in cls._wire_fields}
    names |= {"online", "joining", "draining", "length", "stop", "raw+lz4", ""}
    return sorted(names)


NAMES = _names()


def _corpus() -> list[bytes]:
    frames = [bytes(encode_message(example)) for example in EXAMPLES]
    small = torch.randn(1, 3, 70, generator=torch.Generator().manual_seed(SEED))
    for name in wire.COMPRESSIONS:
        frames.append(
            bytes(
                encode_message(
                    wire.StepResult(session_id="s", step_id=1, hidden_states=small), name
                )
            )
        )
    frames.append(
        bytes(encode_message(wire.ForwardResult(hidden_states=torch.zeros(1, 64, 64)), "raw+lz4"))
    )
    return frames


CORPUS = _corpus()
ENVELOPES = [unpack(frame[4:]) for frame in CORPUS]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 4 or roll < 0.55:
        kind = rng.randrange(8)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return rng.choice(INTERESTING_INTS) * rng.choice([1, 1, -1])
        if kind == 2:
            return rng.randint(-1000, 1000)
        if kind == 3:
            return rng.choice(INTERESTING_FLOATS)
        if kind == 4:
            return rng.choice(NAMES)
        if kind == 5:
            return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(12)))
        return rng.randbytes(rng.choice([0, 1, 2, 3, 4, 8, 12, 64, 70, 280]))
    if roll < 0.75:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(NAMES): random_value(rng, depth + 1) for _ in range(rng.randrange(6))}


def _clamp_ints(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value if -(1 << 63) <= value < 1 << 64 else 0
    if isinstance(value, list):
        return [_clamp_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _clamp_ints(item) for key, item in value.items()}
    return value


def frame_of(obj: Any) -> bytes:
    body = packb(_clamp_ints(obj))
    return len(body).to_bytes(4, "big") + body


# --- byte-level mutations of valid frames ---------------------------------------------------------


def flip_bits(rng: random.Random, data: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 8)):
        index = rng.randrange(len(data))
        data[index] ^= 1 << rng.randrange(8)
    return data


def set_bytes(rng: random.Random, data: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(4, len(data))] = rng.choice([*INTERESTING_BYTES, rng.randrange(256)])
    return data


def truncate(rng: random.Random, data: bytearray) -> bytearray:
    return data[: rng.randrange(len(data))]


def extend(rng: random.Random, data: bytearray) -> bytearray:
    return data + rng.randbytes(rng.randint(1, 64))


def change_length(rng: random.Random, data: bytearray) -> bytearray:
    size = len(data) - 4
    choices = [0, 1, size - 1, size + 1, size + rng.randint(2, 100), MAX_FRAME, MAX_FRAME + 1]
    new = rng.choice([*choices, rng.randrange(1 << 32), (1 << 32) - 1, 10 << 20])
    data[:4] = max(0, min(new, (1 << 32) - 1)).to_bytes(4, "big")
    return data


def cut_body(rng: random.Random, data: bytearray) -> bytearray:
    """Insert or delete bytes inside the body and fix the length, so the frame stays framed."""
    body = data[4:]
    at = rng.randrange(len(body) + 1)
    if rng.random() < 0.5 and body:
        del body[at : at + rng.randint(1, 16)]
    else:
        body[at:at] = rng.randbytes(rng.randint(1, 16))
    return bytearray(len(body).to_bytes(4, "big")) + body


def splice(rng: random.Random, data: bytearray) -> bytearray:
    other = rng.choice(CORPUS)
    return data[: rng.randrange(4, len(data))] + other[rng.randrange(4, len(other)) :]


def random_bytes(rng: random.Random, data: bytearray) -> bytearray:
    body = rng.randbytes(rng.randrange(64))
    header = len(body) if rng.random() < 0.7 else rng.randrange(1 << 32)
    return bytearray(header.to_bytes(4, "big")) + body


BYTE_MUTATIONS: list[Callable[[random.Random, bytearray], bytearray]] = [
    flip_bits,
    set_bytes,
    truncate,
    extend,
    change_length,
    cut_body,
    splice,
    random_bytes,
]


# --- object-level mutations (valid msgpack, broken schema) ---------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


PLAIN_ENVELOPES = [_plain(envelope) for envelope in ENVELOPES]


def mutate_object(rng: random.Random, value: Any) -> Any:
    """Replace, delete or add one random node somewhere inside `value` (a copy)."""
    root = copy.deepcopy(value)
    node = root
    for _ in range(rng.randrange(6)):
        children = (
            list(node.items())
            if isinstance(node, dict)
            else list(enumerate(node))
            if isinstance(node, list)
            else []
        )
        children = [(key, child) for key, child in children if isinstance(child, dict | list)]
        if not children:
            break
        node = rng.choice(children)[1]
    if isinstance(node, dict):
        action = rng.randrange(4)
        if action == 0 and node:
            del node[rng.choice(list(node))]
        elif action == 1:
            node[rng.choice(NAMES)] = random_value(rng)
        elif node:
            key = rng.choice(list(node))
            old = node[key]
            if isinstance(old, bytes) and old and rng.random() < 0.5:
                node[key] = old[: rng.randrange(len(old))] if rng.random() < 0.5 else old + old
            else:
                node[key] = random_value(rng)
    elif isinstance(node, list):
        if node and rng.random() < 0.5:
            node[rng.randrange(len(node))] = random_value(rng)
        elif node and rng.random() < 0.5:
            del node[rng.randrange(len(node))]
        else:
            node.append(random_value(rng))
    return root


def tensor_maps(envelope: Any) -> list[dict[str, Any]]:
    found = []
    if isinstance(envelope, dict):
        if "dtype" in envelope and "data" in envelope:
            found.append(envelope)
        for value in envelope.values():
            found.extend(tensor_maps(value))
    elif isinstance(envelope, list):
        for value in envelope:
            found.extend(tensor_maps(value))
    return found


TENSOR_MAPS = [found for envelope in PLAIN_ENVELOPES for found in tensor_maps(envelope)]


# --- the driver ---------------------------------------------------------------------------------


def feed(rng: random.Random, data: bytes) -> None:
    """Everything a receiver does with the bytes: decode messages until the stream ends."""
    decoder = MessageDecoder(max_frame_size=MAX_FRAME)
    pos = 0
    try:
        while pos < len(data):
            step = rng.randint(1, len(data)) if rng.random() < 0.3 else len(data)
            decoder.receive_data(data[pos : pos + step])
            pos += step
            for _ in decoder:
                pass
        decoder.receive_data(b"")
        for _ in decoder:
            pass
    except ProtocolError:
        pass


def fuzz_case(seed: int, number: int) -> str:
    """Run case `number`; return the name of what it did (raises whatever the decoders raise)."""
    rng = random.Random(seed * 1_000_003 + number)
    roll = rng.random()
    if roll < 0.55:
        mutation = rng.choice(BYTE_MUTATIONS)
        data = mutation(rng, bytearray(rng.choice(CORPUS)))
        if rng.random() < 0.1:  # a good frame before it, and one after
            data = bytearray(rng.choice(CORPUS)) + data + rng.choice(CORPUS)
        feed(rng, bytes(data))
        return mutation.__name__
    if roll < 0.8:
        obj = mutate_object(rng, rng.choice(PLAIN_ENVELOPES))
        with contextlib.suppress(ProtocolError):
            decode_message(obj, max_frame_size=MAX_FRAME)
        feed(rng, frame_of(obj))
        return "mutate_envelope"
    if roll < 0.92:
        value = mutate_object(rng, rng.choice(TENSOR_MAPS))
        with contextlib.suppress(ProtocolError):
            decode_tensor(value, max_bytes=MAX_FRAME)
        return "mutate_tensor_map"
    obj = random_value(rng)
    if rng.random() < 0.5:
        obj = {"protocol": 1, "type": rng.choice(list(wire.message_types())), "body": obj}
    with contextlib.suppress(ProtocolError):
        decode_message(obj if isinstance(obj, dict) else {"x": obj}, max_frame_size=MAX_FRAME)
    feed(rng, frame_of(obj if isinstance(obj, dict) else {"value": obj}))
    return "random_object"


def test_fuzz_decoders_only_raise_protocol_error() -> None:
    failures: list[str] = []
    done: Counter[str] = Counter()
    slowest = 0.0
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    for number in range(CASES):
        case_started = time.perf_counter()
        try:
            done[fuzz_case(SEED, number)] += 1
        except Exception as error:  # anything but ProtocolError escaping is the bug we hunt
            failures.append(f"case {number}: {type(error).__name__}: {error}"[:300])
            if len(failures) >= 5:
                break
        slowest = max(slowest, time.perf_counter() - case_started)
    elapsed = time.perf_counter() - started
    rss_growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    print(f"{sum(done.values())} cases in {elapsed:.1f} s, slowest {slowest * 1e3:.1f} ms,")
    print(f"peak memory +{rss_growth_kib} KiB: {dict(done)}")
    assert not failures, "\n".join(failures)
    assert sum(done.values()) == CASES
    assert slowest < 1.0, f"a case took {slowest:.2f} s: something loops or allocates too much"
    assert rss_growth_kib < 16 * 1024, f"peak memory grew by {rss_growth_kib} KiB while fuzzing"
    assert min(done.values()) > 1000, done
