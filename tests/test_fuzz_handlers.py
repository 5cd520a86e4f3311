"""Fuzzing that reaches the handlers, not just the decoders (the decoders have
tests/test_fuzz_decoders.py and tests/test_wire_fuzz.py):

- random and mutated conversations through a real BlockServer's four protocols (tests/memnet.py:
  real servers of a tiny llama, in one process): sessions opened with odd fields, steps of every
  shape (empty, wrong width, NaN, inf), step ids and positions out of order, pushes into another
  peer's session, forward and backward passes with broken prompts, byte-mutated frames. Every
  case must end its stream within CASE_LIMIT_S of the peer leaving, no handler may raise, no
  answer may be Error(internal) (a bug of ours), and afterwards an honest session still gets the
  right output;
- frames at the real limits, each sent several times with the memory they leave behind measured
  (tracemalloc): the review's object-amplification frame (16 MiB of empty maps), the lz4 frame
  that inflates to three 255 MiB tensors, a frame nested to the decoder's real depth;
- a real client session against a server that answers with wrong shapes, NaN, wrong step ids,
  out-of-order results, errors and garbage: it must route around it and get the right output;
- the local API with a model loaded (a real Generator over the in-process swarm): random and
  mutated requests, then a good client is served.

Seeded, so a failure reproduces; the counts and the slowest case are printed (pytest -s).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import random
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from libp2p.peer.id import ID

import blocks
import wire
from peerd.bench.attack_catalogue import INFLATED_TOKENS, amplification_frame, inflating_tensor
from peerd.daemon.local_api import LocalApi
from peerd.node.p2p import INFERENCE_PROTOCOL, INFO_PROTOCOL, PUSH_PROTOCOL, TRAINING_PROTOCOL
from peerd.node.streams import MessageStream
from peerd.server.block_server import BlockServer
from peerd.session.generation import Generator
from peerd.session.inference import InferenceSession
from peerd.session.swarm import SwarmView
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, MemNode, open_memnet
from tests.numeric import assert_close_scaled
from tests.test_wire_fuzz import BYTE_MUTATIONS
from wire.packing import MAX_ARRAY_LEN, MAX_DEPTH

SEED = 20261201
SERVER_CASES = 400
HOSTILE_CASES = 66
API_CASES = 200
CASE_LIMIT_S = 60.0  # generous: a loaded CI machine; a hang waits for a 300 s idle deadline
BIG_FRAME_REPEATS = 3
HIDDEN = 32  # the tiny llama's hidden size
MAX_FRAME = wire.DEFAULT_MAX_FRAME_SIZE
# Nothing moved for this long after every task blocked: the server has said all it will.
QUIET_S = 0.05

pytestmark = pytest.mark.filterwarnings("ignore::trio.TrioDeprecationWarning")


@pytest.fixture
async def net(tiny_llama: Path) -> AsyncIterator[MemNet]:
    """Servers a (blocks 0:3) and b (3:6)."""
    async with open_memnet() as net:
        net.serve("a", blocks.load_span(tiny_llama, 0, 3))
        net.serve("b", blocks.load_span(tiny_llama, 3, TINY_BLOCKS))
        yield net


# --- building hostile frames ----------------------------------------------------------------


def frame(kind: str, body: dict[str, Any], version: int = wire.PROTOCOL_VERSION) -> bytes:
    """A frame of message type `kind` with `body` as given, past our own schema's checks
    (tensors encoded raw): what a hostile peer can send."""
    fields = {
        k: wire.encode_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in body.items()
    }
    return bytes(wire.encode_frame({"protocol": version, "type": kind, "body": fields}))


def _tensor(rng: random.Random, dims: list[int]) -> torch.Tensor:
    values = torch.randn(*dims, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    if values.numel() and rng.random() < 0.15:
        values.view(-1)[rng.randrange(values.numel())] = rng.choice([math.nan, math.inf, -math.inf])
    return values


def _hidden(rng: random.Random, batch: int = 1) -> torch.Tensor:
    shape = [_pick(rng, batch, 0, 2, 3), _pick(rng, rng.choice([1, 1, 2, 4]), 0, 5)]
    return _tensor(rng, [*shape, _pick(rng, HIDDEN, 0, 31, 33)])


def _pick(rng: random.Random, usual: Any, *odd: Any) -> Any:
    """Mostly the usual value, so that conversations get deep; now and then an odd one."""
    return usual if rng.random() < 0.9 else rng.choice(odd)


def _open(rng: random.Random, net: MemNet, span: tuple[int, int]) -> tuple[bytes, int]:
    batch = _pick(rng, 1, 2, 0, 9, 1 << 20)
    start, end = _pick(rng, span, (span[1], span[0]), (0, 99), (span[0], span[0]))
    body: dict[str, Any] = {
        "session_id": _pick(rng, uuid.uuid4().hex, "", "x" * 200),
        "model": _pick(rng, TINY_MODEL, "other", ""),
        "start": start,
        "end": end,
        "max_length": _pick(rng, 64, 0, 1, 8192, 8193, 1 << 20, -1),
        "batch_size": batch,
        "wait_timeout": 0.0,
    }
    if rng.random() < 0.2:
        body["left_padding"] = [rng.randrange(70) for _ in range(rng.choice([1, 2]))]
    if rng.random() < 0.2:
        body["upstream"] = rng.choice([net.peer_id("a"), net.peer_id("attacker")])
    if rng.random() < 0.2:
        body["next_hops"] = [_next_hop(rng, net)]
    return frame("open_session", body), batch if 1 <= batch <= 3 else 1


def _next_hop(rng: random.Random, net: MemNet) -> dict[str, Any]:
    return {
        "peer_id": rng.choice([net.peer_id("b"), net.peer_id("nobody")]),
        "session_id": uuid.uuid4().hex,
        "start": 3,
        "end": rng.choice([6, 5, 99]),
    }


def _step(rng: random.Random, net: MemNet, session_id: str, step_id: int, batch: int) -> bytes:
    body: dict[str, Any] = {
        "session_id": _pick(rng, session_id, "other", uuid.uuid4().hex),
        "step_id": _pick(rng, step_id, 0, step_id - 1, 1 << 62, -1),
        "hidden_states": _hidden(rng, batch),
    }
    if rng.random() < 0.3:
        body["start_position"] = rng.choice([0, 1, 3, 63, 64, 1 << 19, -1])
    if rng.random() < 0.15:
        body["next_hops"] = [_next_hop(rng, net)]
    return frame("step", body)


def _inference_case(rng: random.Random, net: MemNet) -> list[bytes]:
    opened, batch = _open(rng, net, (0, 3))
    session_id = wire.decode_frame(opened[:])["body"]["session_id"]
    frames = [opened]
    frames += [_step(rng, net, session_id, i, batch) for i in range(rng.randrange(4))]
    if rng.random() < 0.3:
        frames.append(frame("close_session", {"session_id": session_id}))
    return frames


def _training_case(rng: random.Random) -> list[bytes]:
    frames = []
    for _ in range(rng.randint(1, 3)):
        hidden = _hidden(rng)
        body: dict[str, Any] = {"model": _pick(rng, TINY_MODEL, "x"), "hidden_states": hidden}
        body |= dict(zip(("start", "end"), _pick(rng, (0, 3), (1, 2), (2, 1), (0, 6)), strict=True))
        if rng.random() < 0.3:
            prefix = rng.choice([0, 1, 2, 9])
            dims = [rng.choice([3, 1, 2]), rng.choice([1, 2]), prefix, rng.choice([HIDDEN, 7])]
            body["prompts"] = _tensor(rng, dims)
        kind = rng.choice(["forward", "backward"])
        if kind == "backward":
            body["grad_outputs"] = _pick(rng, _tensor(rng, list(hidden.shape)), _hidden(rng))
        frames.append(frame(kind, body))
    return frames


def _push_case(rng: random.Random, net: MemNet, victim: str) -> list[bytes]:
    return [_step(rng, net, victim, rng.randrange(1, 9), 1) for _ in range(rng.randint(1, 4))]


def _mutated(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    if rng.random() < 0.2:
        at = rng.randrange(len(frames))
        frames[at] = bytes(rng.choice(BYTE_MUTATIONS)(rng, bytearray(frames[at])))
    return frames


def server_case(rng: random.Random, net: MemNet, victim: str) -> tuple[str, str, list[bytes]]:
    """(server name, protocol, frames) of one random conversation."""
    roll = rng.random()
    if roll < 0.45:
        return "a", INFERENCE_PROTOCOL, _mutated(rng, _inference_case(rng, net))
    if roll < 0.7:
        return "a", TRAINING_PROTOCOL, _mutated(rng, _training_case(rng))
    if roll < 0.85:
        return "b", PUSH_PROTOCOL, _mutated(rng, _push_case(rng, net, victim))
    info = [frame(rng.choice(["info_request", "step_result", "nonsense"]), {})]
    return "a", INFO_PROTOCOL, _mutated(rng, info)


# --- running cases ----------------------------------------------------------------------------


async def exchange(
    node: MemNode, net: MemNet, name: str, protocol: str, frames: list[bytes]
) -> list[str]:
    """Send `frames` on a fresh stream to server `name`, read what comes back until everything
    in this process waits, then leave; wait for the server's handler to end (a hang fails)."""
    served = net.served_by_id(net.peer_id(name))
    assert served is not None
    before = len(served.scopes)
    raw = await node.open_stream(ID.from_base58(net.peer_id(name)), protocol)
    stream = MessageStream(raw, MAX_FRAME)
    replies: list[str] = []
    ended: list[bool] = []

    async def read() -> None:
        while True:
            try:
                message = await stream.receive(CASE_LIMIT_S)
            except Exception as e:  # the end, or what a broken reply looks like to us
                replies.append(type(e).__name__)
                ended.append(True)
                return
            replies.append(
                f"error:{message.code}" if isinstance(message, wire.Error) else message.TYPE
            )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for data in frames:
            try:
                await raw.write(data)
            except trio.BrokenResourceError:  # it hung up on us already
                break
        await settle(net)
        nursery.cancel_scope.cancel()
    await stream.close()
    while len(served.scopes) > before:  # its handler ends once it sees us gone
        await trio.sleep(0.001)
    return replies


async def settle(net: MemNet) -> None:
    """Until everything the frames set off is done: every task waits (for the next message,
    mostly) and no server has a step or pass queued or computing in its worker thread."""
    while True:
        await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        if all(net.server(name).compute.depth == 0 for name in ("a", "b")):
            return
        await trio.sleep(0.001)


async def _honest_session(
    node: MemNode, net: MemNet, name: str, upstream: str
) -> tuple[MessageStream, str]:
    raw = await node.open_stream(ID.from_base58(net.peer_id(name)), INFERENCE_PROTOCOL)
    stream = MessageStream(raw, MAX_FRAME)
    session_id = uuid.uuid4().hex
    await stream.send(
        wire.OpenSession(
            session_id=session_id,
            model=TINY_MODEL,
            start=3,
            end=6,
            max_length=64,
            upstream=upstream,
        )
    )
    assert isinstance(await stream.receive(CASE_LIMIT_S), wire.SessionOpened)
    return stream, session_id


def _internal_errors(*servers: BlockServer) -> int:
    return sum(s.counters.errors.get(wire.ErrorCode.INTERNAL, 0) for s in servers)


async def test_random_conversations_reach_every_handler_and_none_breaks(
    net: MemNet, tiny_llama: Path
) -> None:
    """SERVER_CASES conversations on a and b; meanwhile an honest session on b (taking pushes
    from a only) is the push target; it must still answer right at the end."""
    honest, victim = await _honest_session(net.node("client"), net, "b", upstream=net.peer_id("a"))
    attacker = net.node("attacker")
    rng = random.Random(SEED)
    replies: Counter[str] = Counter()
    slowest = (0.0, -1)
    inputs = 0
    for number in range(SERVER_CASES):
        name, protocol, frames = server_case(rng, net, victim)
        started = time.perf_counter()
        with trio.fail_after(CASE_LIMIT_S):
            replies.update(await exchange(attacker, net, name, protocol, frames))
        slowest = max(slowest, (time.perf_counter() - started, number))
        inputs += len(frames)
    print(
        f"{SERVER_CASES} conversations, {inputs} frames through the handlers; slowest: case "
        f"{slowest[1]} in {slowest[0] * 1e3:.0f} ms; replies {dict(replies.most_common(12))}"
    )
    assert _internal_errors(net.server("a"), net.server("b")) == 0
    assert replies["step_result"] and replies["forward_result"] and replies["error:bad_request"]
    hidden = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
    await honest.send(wire.Step(session_id=victim, step_id=0, hidden_states=hidden))
    result = await honest.receive_as(wire.StepResult, CASE_LIMIT_S)
    want = blocks.load_span(tiny_llama, 3, TINY_BLOCKS)(hidden)
    assert_close_scaled(result.hidden_states, want)


# --- frames at the real limits ----------------------------------------------------------------


def _big_frames() -> dict[str, tuple[str, bytes]]:
    """The review's hostile frames at full size, and one nested to the decoder's real depth."""
    inflating = inflating_tensor(INFLATED_TOKENS, 576)
    backward = {"model": TINY_MODEL, "start": 0, "end": 3, "hidden_states": inflating}
    backward |= {"grad_outputs": inflating, "prompts": inflating_tensor(INFLATED_TOKENS, 576, 4)}
    envelope = {"protocol": wire.PROTOCOL_VERSION, "type": "backward", "body": backward}
    deepest: Any = [0] * MAX_ARRAY_LEN
    for _ in range(MAX_DEPTH - 3):  # the envelope and the body are two levels
        deepest = [deepest]
    nested = {"protocol": wire.PROTOCOL_VERSION, "type": "info_request", "body": {"x": deepest}}
    return {
        "16 MiB of empty maps in arrays, on info": (INFO_PROTOCOL, amplification_frame(16 << 20)),
        "lz4 tensors inflating to 3 x 255 MiB, on training": (
            TRAINING_PROTOCOL,
            bytes(wire.encode_frame(envelope)),
        ),
        f"arrays nested {MAX_DEPTH} deep, on info": (
            INFO_PROTOCOL,
            bytes(wire.encode_frame(nested)),
        ),
    }


async def test_frames_at_the_real_limits_are_answered_in_time_and_leave_no_memory_behind(
    net: MemNet,
) -> None:
    """Each frame BIG_FRAME_REPEATS times: every one answered (or its stream ended) within the
    case limit, and the memory Python holds after the last one (tracemalloc) no more than after
    the first: a decoder that keeps what a refused frame built grows by the frame each time."""
    attacker = net.node("attacker")
    tracemalloc.start()
    try:
        for name, (protocol, data) in _big_frames().items():
            held, timings = [], []
            for _ in range(BIG_FRAME_REPEATS):
                started = time.perf_counter()
                with trio.fail_after(CASE_LIMIT_S):
                    replies = await exchange(attacker, net, "a", protocol, [data])
                timings.append(time.perf_counter() - started)
                gc.collect()
                held.append(tracemalloc.get_traced_memory()[0])
                assert replies and replies[0] in ("error:bad_request", "PeerGone"), (name, replies)
            growth = held[-1] - held[0]
            print(
                f"{name}: {len(data) >> 20} MiB, slowest {max(timings) * 1e3:.0f} ms, "
                f"held +{growth >> 10} KiB after {BIG_FRAME_REPEATS} frames"
            )
            assert growth < 4 << 20, (name, held)
    finally:
        tracemalloc.stop()
    assert _internal_errors(net.server("a")) == 0


# --- a client against a server that answers garbage -------------------------------------------

HOSTILE_REPLIES = (
    "wrong_width",
    "wrong_tokens",
    "wrong_batch",
    "nan",
    "inf",
    "wrong_step_id",
    "out_of_order",
    "wrong_session",
    "error",
    "garbage",
    "hang_up",
)
"""(A hop that answers a right-looking result and then never pushes it on is not here: the client
finds out only at its step timeout, as with a slow server.)"""


async def _hostile_inference(mode: list[str], counts: Counter[str], raw: Any, peer: str) -> None:
    """A server's inference handler that opens any session and answers each step as `mode[0]`
    says (changed by the test between sessions)."""
    stream = MessageStream(raw, MAX_FRAME)
    try:
        request = await stream.receive_as(wire.OpenSession, CASE_LIMIT_S)
        await stream.send(
            wire.SessionOpened(session_id=request.session_id, max_length=request.max_length)
        )
        counts[mode[0]] += 1
        rng = random.Random(counts.total())
        while isinstance(step := await stream.receive(CASE_LIMIT_S), wire.Step):
            if mode[0] == "hang_up":
                break
            for data in _hostile_replies(mode[0], request.session_id, step, rng):
                await raw.write(data)
    except Exception:  # the client hung up on us: what a client does with a liar
        pass
    finally:
        await stream.close()


def _hostile_replies(
    mode: str, session_id: str, step: wire.Step, rng: random.Random
) -> list[bytes]:
    batch, tokens, width = step.hidden_states.shape
    shape = {"wrong_width": (batch, tokens, width + 1), "wrong_tokens": (batch, tokens + 1, width)}
    shape["wrong_batch"] = (batch + 1, tokens, width)
    hidden = torch.randn(*shape.get(mode, (batch, tokens, width)))
    if mode in ("nan", "inf"):
        hidden.view(-1)[rng.randrange(hidden.numel())] = math.nan if mode == "nan" else math.inf
    body = {"session_id": session_id, "step_id": step.step_id, "hidden_states": hidden}
    if mode == "wrong_step_id":
        body["step_id"] = step.step_id + 5
    if mode == "wrong_session":
        body["session_id"] = "someone-else"
    if mode == "error":
        return [frame("error", {"code": "internal", "message": "no"})]
    if mode == "garbage":
        return [bytes(rng.randrange(256) for _ in range(64))]
    if mode == "out_of_order":
        later = dict(body, step_id=step.step_id + 1)
        return [frame("step_result", later), frame("step_result", body)]
    return [frame("step_result", body)]


async def test_a_client_session_routes_around_a_server_that_answers_garbage(
    tiny_llama: Path,
) -> None:
    """Server h (blocks 0:3, announcing the most throughput, so routes take it first) answers
    every step with one of HOSTILE_REPLIES; each session must leave it and give the output the
    honest servers give, never a torch error, a hang or a wrong tensor."""
    rng = random.Random(SEED)
    inputs = [torch.randn(1, 3, HIDDEN), torch.randn(1, 1, HIDDEN)]
    mode, counts = [HOSTILE_REPLIES[0]], Counter[str]()
    slowest = (0.0, -1)
    async with open_memnet() as net:
        net.serve("a", blocks.load_span(tiny_llama, 0, 3))
        net.serve("b", blocks.load_span(tiny_llama, 3, TINY_BLOCKS))
        reference = await _outputs(net, ["a", "b"], inputs)
        hostile = net.serve("h", blocks.load_span(tiny_llama, 0, 3))
        hostile.throughput = 1000.0
        hostile.handle_inference = functools.partial(_hostile_inference, mode, counts)  # type: ignore[method-assign]
        for case in range(HOSTILE_CASES):
            mode[0] = (
                HOSTILE_REPLIES[case % len(HOSTILE_REPLIES)]
                if case < 2 * len(HOSTILE_REPLIES)
                else rng.choice(HOSTILE_REPLIES)
            )
            started = time.perf_counter()
            with trio.fail_after(CASE_LIMIT_S * 3):
                outputs = await _outputs(net, None, inputs)
            slowest = max(slowest, (time.perf_counter() - started, case))
            for got, want in zip(outputs, reference, strict=True):
                assert_close_scaled(got, want)
    print(
        f"{HOSTILE_CASES} client sessions met a hostile server: {dict(counts)}; slowest: case "
        f"{slowest[1]} in {slowest[0] * 1e3:.0f} ms"
    )
    assert counts.total() >= HOSTILE_CASES // 2, counts  # the routes did go through it


async def _outputs(
    net: MemNet, names: list[str] | None, inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    view = SwarmView(net.node("client"), TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]
    view.records = net.records(names)
    async with InferenceSession(view, max_length=16) as session:
        return [await session.step(hidden) for hidden in inputs]


# --- the local API with a model loaded --------------------------------------------------------


class _Listener(trio.abc.Listener[trio.abc.Stream]):
    """Hands the local API the server ends of in-memory connections."""

    def __init__(self) -> None:
        self.send, self.incoming = trio.open_memory_channel[trio.abc.Stream](8)

    async def connect(self) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        await self.send.send(server)
        return client

    async def accept(self) -> trio.abc.Stream:
        return await self.incoming.receive()

    async def aclose(self) -> None:
        await self.incoming.aclose()


def _api_request(rng: random.Random, sessions: list[str]) -> bytes:
    """One random local API request (tensor widths, token ids, lengths near and past limits)."""
    kind = rng.choice(["generate", "open", "step", "close", "forward", "backward", "status"])
    if kind == "generate":
        body: dict[str, Any] = {"max_new_tokens": _pick(rng, rng.randint(1, 3), 0, 1 << 20)}
        body["input_ids"] = [_pick(rng, rng.randrange(100), 1 << 30, -1) for _ in range(3)]
        if rng.random() < 0.3:
            body["sampling"] = {"do_sample": True, "temperature": _pick(rng, 0.7, 0.0, -1.0, 1e-30)}
            body["sampling"] |= {"top_p": _pick(rng, 0.9, 0.0, 2.0), "seed": rng.randrange(9)}
        if rng.random() < 0.2 and sessions:
            body["session_id"] = rng.choice(sessions)
        return frame("generate", body)
    if kind == "open":
        return frame("open_inference", {"max_length": _pick(rng, 16, 0, 1 << 20, 1 << 40)})
    session = rng.choice(sessions) if sessions and rng.random() < 0.8 else "nope"
    if kind == "step":
        return frame("inference_step", {"session_id": session, "hidden_states": _hidden(rng)})
    if kind == "close":
        return frame("close_inference", {"session_id": session})
    if kind == "forward":
        return frame(
            "training_forward", {"hidden_states": _hidden(rng), "keep": rng.random() < 0.5}
        )
    if kind == "backward":
        body = {"forward_id": _pick(rng, "f", uuid.uuid4().hex), "grad_outputs": _hidden(rng)}
        return frame("training_backward", body)
    return frame("status_request", {})


async def _api_exchange(
    listener: _Listener, requests: list[bytes], until: str | None = None
) -> list[str]:
    """Hello, then `requests` on one connection; what came back until all is quiet (or, with
    `until`, until a reply of that type or an error came)."""
    stream = await listener.connect()
    decoder = wire.MessageDecoder()
    replies: list[str] = []

    async def read() -> None:
        with contextlib.suppress(Exception):  # the end, or a broken reply: not ours to judge
            while data := await stream.receive_some(1 << 16):
                decoder.receive_data(data)
                replies.extend(
                    f"error:{m.code}" if isinstance(m, wire.Error) else m.TYPE for m in decoder
                )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            for data in [bytes(wire.encode_message(wire.Hello())), *requests]:
                await stream.send_all(data)
        if until is not None:
            while not any(r == until or r.startswith("error") for r in replies):
                await trio.sleep(0.01)
        seen = -1
        while len(replies) != seen:
            seen = len(replies)
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            with trio.move_on_after(QUIET_S):
                while len(replies) == seen:
                    await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    await stream.aclose()
    return replies


async def test_the_local_api_with_a_model_loaded_takes_random_requests_and_serves_on(
    tiny_llama: Path,
) -> None:
    """A real LocalApi whose Generator runs the tiny llama over the in-process swarm: random
    and mutated generate, session, step and training requests, API_CASES connections; no
    request is answered Error(internal), and a good generation comes out whole afterwards."""
    checkpoint = tiny_llama_with_tokenizer(tiny_llama)
    rng = random.Random(SEED)
    replies: Counter[str] = Counter()
    slowest = (0.0, -1)
    async with open_memnet() as net:
        net.serve("a", blocks.load_span(checkpoint, 0, 3))
        net.serve("b", blocks.load_span(checkpoint, 3, TINY_BLOCKS))
        view = SwarmView(net.node("client"), TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]
        view.records = net.records()
        view.refresh = _no_dht  # type: ignore[method-assign]  # a memnet has no DHT to ask
        generator = Generator(blocks.load_client_side(checkpoint), view)

        async def get_generator() -> Generator:
            return generator

        welcome = wire.Welcome(
            version="0", peer_id="p", model=TINY_MODEL, num_blocks=6, hidden_size=HIDDEN
        )
        api = LocalApi(
            socket_path=checkpoint / "unused.sock",
            get_generator=get_generator,
            status=lambda: wire.StatusResponse(peer_id="p", version="0", uptime_s=0.0),
            welcome=lambda: welcome,
        )
        listener = _Listener()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(api.serve_listener, listener)
            for case in range(API_CASES):
                requests = [_api_request(rng, ["nope"]) for _ in range(rng.randint(1, 3))]
                started = time.perf_counter()
                with trio.fail_after(CASE_LIMIT_S):
                    replies.update(await _api_exchange(listener, _mutated(rng, requests)))
                slowest = max(slowest, (time.perf_counter() - started, case))
            good = frame("generate", {"input_ids": [1, 2, 3], "max_new_tokens": 3})
            with trio.fail_after(CASE_LIMIT_S):
                last = await _api_exchange(listener, [good], until="generate_done")
            nursery.cancel_scope.cancel()
    print(
        f"{API_CASES} local API connections with a model loaded: {dict(replies.most_common(10))}"
        f"; slowest: case {slowest[1]} in {slowest[0] * 1e3:.0f} ms"
    )
    assert replies["error:internal"] == 0, replies
    assert last[-1] == "generate_done", last
    assert replies["inference_opened"] and replies["error:bad_request"], replies


async def _no_dht() -> None:
    """What SwarmView.refresh finds on a memnet: the records it holds already."""


def tiny_llama_with_tokenizer(path: Path) -> Path:
    """The tiny llama beside the default model's tokenizer (its ids cover the tiny vocabulary)."""
    from transformers import AutoTokenizer

    if not (path / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(blocks.resolve_checkpoint("default"))
        tokenizer.save_pretrained(path)
    return path
