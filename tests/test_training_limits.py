"""Training under hostile load, in process (real BlockServers over tests/memnet.py): a peer
refused for its quota cannot make the server decode its next request before it has room, the
memory training work freed goes back to the system, and a client splits its micro-batches to the
token cap a slow server states. Nothing here asserts on wall time."""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from libp2p.peer.id import ID

import blocks
import wire
from peerd.node.p2p import TRAINING_PROTOCOL
from peerd.node.streams import MessageStream
from peerd.server.block_server import ServerLimits
from peerd.server.memory import MemoryTrim
from peerd.session.swarm import SwarmView
from peerd.session.training import CHUNK_TOKENS, Trainer
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, open_memnet, save_tiny_llama
from tests.numeric import assert_close_scaled
from tests.test_server_fairness import HIDDEN, TIMEOUT_S, _hold_device, _random, _until


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("training-limits"))


@pytest.fixture
def gates() -> Iterator[list[threading.Event]]:
    events: list[threading.Event] = []
    yield events
    for event in events:
        event.set()  # never leave a worker thread blocked


async def _stream(net: MemNet, who: str, server: str) -> MessageStream:
    raw = await net.node(who).open_stream(ID.from_base58(net.peer_id(server)), TRAINING_PROTOCOL)
    return MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)


async def test_a_stream_refused_for_its_quota_is_read_again_only_once_the_peer_has_room(
    tiny_llama: Path, gates: list[threading.Event]
) -> None:
    """The training flood: a peer over its quota sent again at once and every request was
    decoded (megabytes each) on the event loop, then refused, dozens of times a second. Now
    its stream's next request waits, undecoded, until one of its requests is answered."""
    async with open_memnet() as net:
        server = net.serve("a", blocks.load_span(tiny_llama, 0, 3))
        request = wire.Forward(
            model=TINY_MODEL, start=0, end=3, hidden_states=_random(1, 4, HIDDEN, seed=7)
        )
        async with trio.open_nursery() as nursery:
            started, release = await _hold_device(nursery, server, gates)
            await _until(started.is_set)
            heavy = [await _stream(net, "heavy", "a") for _ in range(3)]
            for stream in heavy[:2]:
                await stream.send(request)
            await _until(lambda: server.admission.training_of(net.peer_id("heavy")) == 2)
            await heavy[2].send(request)
            refused = await heavy[2].receive(TIMEOUT_S)
            assert isinstance(refused, wire.Error) and refused.code == wire.ErrorCode.INFLIGHT_LIMIT
            await heavy[2].send(request)  # at once, its quota still full
            release.set()
            for stream in heavy:  # the resent request was read when there was room: served
                assert isinstance(await stream.receive(TIMEOUT_S), wire.ForwardResult)
        assert server.counters.errors == {wire.ErrorCode.INFLIGHT_LIMIT: 1}


def test_memory_is_trimmed_after_work_that_freed_it_at_most_once_a_period() -> None:
    trims: list[int] = []
    memory = MemoryTrim(every_s=1.0, trim=lambda: trims.append(1))
    assert not memory.take(now=0.0)  # nothing freed yet
    memory.freed()
    assert memory.take(now=0.0)
    memory.freed()
    assert not memory.take(now=0.5)  # trimmed 0.5 s ago
    assert memory.take(now=0.5, last_work=True)  # but nothing else would trim after this
    assert not memory.take(now=5.0)  # nothing freed since
    memory.freed()
    assert memory.take(now=5.0)
    memory.trim()
    assert trims == [1] and memory.trims == 1


async def test_the_server_trims_its_memory_after_the_last_training_request(
    tiny_llama: Path,
) -> None:
    """The flood left ~300 MB resident in glibc's heaps after every request was answered."""
    async with open_memnet() as net:
        server = net.serve("a", blocks.load_span(tiny_llama, 0, 3))
        trims: list[int] = []
        server.compute.memory = MemoryTrim(every_s=3600.0, trim=lambda: trims.append(1))
        stream = await _stream(net, "client", "a")
        hidden = _random(1, 4, HIDDEN, seed=8)
        for _ in range(2):
            await stream.send(wire.Forward(model=TINY_MODEL, start=0, end=3, hidden_states=hidden))
            assert isinstance(await stream.receive(TIMEOUT_S), wire.ForwardResult)
        # The first slice trimmed (once an hour at most); each answered request was the last
        # training work for a while, and trimmed too.
        await _until(lambda: len(trims) == 3)


async def test_a_client_splits_its_micro_batches_to_the_cap_a_slow_server_states(
    tiny_llama: Path,
) -> None:
    """A slow server caps its requests below the client's CHUNK_TOKENS (its backward must finish
    within the client's timeout); the client used to give up on it (bad_request). Now it sends
    that hop again in micro-batches of the stated cap, and gets the whole span's result."""
    whole = blocks.load_span(tiny_llama, 0, TINY_BLOCKS)
    hidden = _random(4, 6, HIDDEN, seed=9)  # 24 tokens: over the head's cap of 16
    grad_out = _random(4, 6, HIDDEN, seed=10)
    async with open_memnet() as net:
        net.serve(
            "head", blocks.load_span(tiny_llama, 0, 3), limits=ServerLimits(max_training_tokens=16)
        )
        net.serve("tail", blocks.load_span(tiny_llama, 3, TINY_BLOCKS))
        view = SwarmView(net.node("client"), TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]
        view.records = net.records()
        trainer = Trainer(view)
        output, forward_id, _ = await trainer.forward(hidden, None, keep=True)
        assert trainer.caps == {net.peer_id("head"): 16}
        assert trainer.failures == 0 and view.bans.failures(net.peer_id("head")) == 0
        assert forward_id is not None
        grad, _, route = await trainer.backward(forward_id, grad_out)
        assert route[0].startswith(net.peer_id("head"))
        served = net.server("head").counters.training_passes
        assert served >= 2 * 2  # two micro-batches of two rows each way (and the refused one)
    x = hidden.clone().requires_grad_(True)
    reference = whole(x)
    reference.backward(grad_out)
    assert_close_scaled(output, reference.detach())
    assert x.grad is not None
    assert_close_scaled(grad, x.grad)
    assert CHUNK_TOKENS > 16


async def test_a_request_whose_peer_closed_the_stream_is_given_up(
    tiny_llama: Path, gates: list[threading.Event]
) -> None:
    """A flood's requests ran on (slice after slice, minutes with the rests) long after their
    sender had left; now a request stops at its next slice when its stream closes."""
    async with open_memnet() as net:
        server = net.serve("a", blocks.load_span(tiny_llama, 0, 3))
        request = wire.Forward(
            model=TINY_MODEL, start=0, end=3, hidden_states=_random(1, 4, HIDDEN, seed=11)
        )
        async with trio.open_nursery() as nursery:
            started, release = await _hold_device(nursery, server, gates)
            await _until(started.is_set)
            stream = await _stream(net, "leaver", "a")
            await stream.send(request)
            await _until(lambda: server.admission.training_of(net.peer_id("leaver")) == 1)
            await stream.close()
            await _until(lambda: server.admission.training_inflight == 0)
            release.set()
        assert server.counters.training_slices == 0  # its first slice never ran
        # The server serves on.
        other = await _stream(net, "other", "a")
        await other.send(request)
        assert isinstance(await other.receive(TIMEOUT_S), wire.ForwardResult)


async def test_garbage_sent_while_a_request_runs_ends_that_stream_only(
    tiny_llama: Path, gates: list[threading.Event]
) -> None:
    """The server reads a training stream while its request runs (to see it close): bytes that
    are no message there give the request up and end the stream with `bad_request`, a peer's
    fault (not `internal`, a bug of ours), and the server serves on."""
    async with open_memnet() as net:
        server = net.serve("a", blocks.load_span(tiny_llama, 0, 3))
        request = wire.Forward(
            model=TINY_MODEL, start=0, end=3, hidden_states=_random(1, 4, HIDDEN, seed=12)
        )
        async with trio.open_nursery() as nursery:
            started, release = await _hold_device(nursery, server, gates)
            await _until(started.is_set)
            stream = await _stream(net, "garbler", "a")
            await stream.send(request)
            await _until(lambda: server.admission.training_of(net.peer_id("garbler")) == 1)
            await stream.stream.write(struct.pack(">I", 4) + b"\xc1" * 4)  # 0xc1: never msgpack
            await _until(lambda: server.admission.training_inflight == 0)
            release.set()
        refused = await stream.receive(TIMEOUT_S)
        assert isinstance(refused, wire.Error) and refused.code == wire.ErrorCode.BAD_REQUEST
        assert server.counters.training_slices == 0
        assert wire.ErrorCode.INTERNAL not in server.counters.errors
        other = await _stream(net, "other", "a")
        await other.send(request)
        assert isinstance(await other.receive(TIMEOUT_S), wire.ForwardResult)
