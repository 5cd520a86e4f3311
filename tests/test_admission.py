"""Admission control of a block server (peerd.server.admission): the FIFO wait for cache, its typed
timeout, and the per-peer limits on sessions and bytes in flight (pure trio), then the same
against a real daemon over libp2p."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

import wire
from blocks import MemoryCache, SpanSession
from peerd.devtools.localswarm import LocalSwarm
from peerd.node.p2p import INFERENCE_PROTOCOL, INFO_PROTOCOL, Node, open_node, parse_peer_maddr
from peerd.node.streams import MessageStream
from peerd.server.admission import Admission, Refused


def _admission(**limits: int) -> Admission:
    return Admission(
        max_sessions_per_peer=limits.get("sessions", 4),
        max_inflight_bytes_per_peer=limits.get("inflight", 100),
    )


async def test_waiting_sessions_get_cache_in_arrival_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=100)
    admission = _admission()
    held = cache.open_session(1, 60)
    order: list[str] = []
    opened: list[SpanSession] = []

    async def ask(name: str, tokens: int) -> None:
        opened.append(await admission.open_session(cache, 1, tokens, wait_s=30))
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "big", 60)
        await trio.sleep(1)
        # 40 tokens are free, enough for "small", but "big" came first and waits at the head.
        nursery.start_soon(ask, "small", 30)
        await trio.sleep(1)
        assert order == [] and admission.queued == 2 and admission.queued_tokens == 90
        held.close()
        admission.cache_freed()
    assert order == ["big", "small"]
    assert admission.queued == 0 and cache.free_tokens == 10
    for session in opened:
        session.close()


async def test_a_wait_that_times_out_is_a_typed_explained_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=100)
    admission = _admission()
    held = cache.open_session(1, 70)
    started = trio.current_time()
    with pytest.raises(Refused) as refused:
        await admission.open_session(cache, 2, 25, wait_s=5)
    assert refused.value.code == wire.ErrorCode.CACHE_FULL_TIMEOUT
    assert trio.current_time() - started == pytest.approx(5)
    message = str(refused.value)
    assert "30 of 100 tokens free" in message and "asks for 50" in message
    assert "another server" in message
    assert admission.timeouts == 1 and admission.queued == 0
    # The cache is untouched and the next request that fits gets in at once.
    held.close()
    (await admission.open_session(cache, 2, 25, wait_s=0)).close()


async def test_the_wait_is_capped_and_oversized_sessions_are_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=100)
    admission = Admission(max_sessions_per_peer=4, max_inflight_bytes_per_peer=1, max_wait_s=2)
    with pytest.raises(Refused) as refused:
        await admission.open_session(cache, 1, 101, wait_s=30)
    assert refused.value.code == wire.ErrorCode.OUT_OF_CACHE
    assert "whole cache of 100" in str(refused.value)
    held = cache.open_session(1, 100)
    started = trio.current_time()
    with pytest.raises(Refused, match=r"after waiting 2\.0 s"):
        await admission.open_session(cache, 1, 1, wait_s=3600)
    assert trio.current_time() - started == pytest.approx(2)
    held.close()


async def test_a_full_queue_says_busy(autojump_clock: trio.testing.MockClock) -> None:
    cache = MemoryCache(budget_tokens=10)
    admission = Admission(max_sessions_per_peer=9, max_inflight_bytes_per_peer=1, max_queued=2)
    held = cache.open_session(1, 10)
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(admission.open_session, cache, 1, 5, 10.0)
        await trio.sleep(1)
        with pytest.raises(Refused) as refused:
            await admission.open_session(cache, 1, 5, wait_s=10)
        assert refused.value.code == wire.ErrorCode.BUSY
        held.close()
        admission.cache_freed()
    assert cache.free_tokens == 0


def test_sessions_per_peer_are_limited_and_other_peers_go_on() -> None:
    admission = _admission(sessions=2)
    with admission.session_slot("a"), admission.session_slot("a"):
        with pytest.raises(Refused) as refused, admission.session_slot("a"):
            pass
        assert refused.value.code == wire.ErrorCode.TOO_MANY_SESSIONS
        assert "peer a" in str(refused.value)
        with admission.session_slot("b"):
            assert admission.sessions_of("b") == 1
    assert admission.sessions_of("a") == 0
    with admission.session_slot("a"):
        pass


def test_bytes_in_flight_per_peer_are_limited() -> None:
    admission = _admission(inflight=100)
    # One step alone always runs, even past the limit (else a big prefill could never run).
    with admission.inflight("a", 150):
        assert admission.inflight_bytes_of("a") == 150
        with pytest.raises(Refused) as refused, admission.inflight("a", 10):
            pass
        assert refused.value.code == wire.ErrorCode.INFLIGHT_LIMIT
        assert "150 bytes" in str(refused.value)
        with admission.inflight("b", 60), admission.inflight("b", 40):
            assert admission.inflight_bytes_of("b") == 100
    assert admission.inflight_bytes_of("a") == admission.inflight_bytes_of("b") == 0


# --- a real daemon -------------------------------------------------------------------------------


async def _open(node: Node, peer: str, max_length: int, wait: float) -> tuple[Any, Any]:
    """(stream, first reply) of an OpenSession on blocks 10:20 of the default model."""
    raw = await node.host.new_stream(ID.from_base58(peer), [INFERENCE_PROTOCOL])
    stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
    await stream.send(
        wire.OpenSession(
            session_id=uuid.uuid4().hex,
            model="smollm2-135m-instruct",
            start=10,
            end=20,
            max_length=max_length,
            wait_timeout=wait,
        )
    )
    return stream, await stream.receive(30)


async def _step(stream: Any, opened: wire.SessionOpened, step_id: int) -> None:
    """One token through the session: its lease is fresh again for 5 s."""
    hidden = torch.zeros(1, 1, 576)
    await stream.send(
        wire.Step(session_id=opened.session_id, step_id=step_id, hidden_states=hidden)
    )
    assert isinstance(await stream.receive(60), wire.StepResult)


class _KeepStepping:
    """Steps a session one token at a time until stopped: its lease is never idle."""

    def __init__(self, stream: Any, opened: wire.SessionOpened) -> None:
        self.stream, self.opened = stream, opened
        self.running = True
        self.done = trio.Event()

    async def run(self) -> None:
        step_id = 0
        while self.running:
            await _step(self.stream, self.opened, step_id)
            step_id += 1
        self.done.set()

    async def stop(self) -> None:
        self.running = False
        await self.done.wait()


async def _record(node: Node, peer: str) -> wire.ServerInfo:
    raw = await node.host.new_stream(ID.from_base58(peer), [INFO_PROTOCOL])
    stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
    await stream.send(wire.InfoRequest())
    reply = await stream.receive(10)
    await stream.close()
    assert isinstance(reply, wire.InfoResponse)
    return reply.record


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_a_full_daemon_queues_then_refuses_with_a_typed_error(swarm: LocalSwarm) -> None:
    daemon = swarm.daemons[1]  # blocks 10:20, 16384 tokens of cache
    addrs = ["/ip4/127.0.0.1/tcp/0"]
    async with (
        open_node(create_new_key_pair(), addrs) as node,
        open_node(create_new_key_pair(), addrs) as first_hog,
        open_node(create_new_key_pair(), addrs) as second_hog,
    ):
        for peer in (node, first_hog, second_hog):
            await peer.connect(parse_peer_maddr(daemon.maddr))
        record = await _record(node, daemon.peer_id)
        assert (record.max_session_length, record.max_sessions_per_peer) == (8192, 64)
        assert record.max_inflight_bytes_per_peer == 256 << 20
        assert record.free_cache_tokens == 16384
        # One peer may hold half the cache: a second 8192-token session of it is refused.
        first, first_opened = await _open(first_hog, daemon.peer_id, 8192, 0)
        assert isinstance(first_opened, wire.SessionOpened)
        _, reply = await _open(first_hog, daemon.peer_id, 8192, 0)
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.OUT_OF_CACHE
        # Two sessions of 8192 tokens of two peers fill the cache.
        second, second_opened = await _open(second_hog, daemon.peer_id, 8192, 0)
        assert isinstance(second_opened, wire.SessionOpened)
        async with trio.open_nursery() as nursery:
            # Hogs that keep stepping are never idle: a short wait ends in vain.
            hogs = [_KeepStepping(first, first_opened), _KeepStepping(second, second_opened)]
            for hog in hogs:
                nursery.start_soon(hog.run)
            started = trio.current_time()
            _, reply = await _open(node, daemon.peer_id, 1000, 0.5)
            assert isinstance(reply, wire.Error)
            assert reply.code == wire.ErrorCode.CACHE_FULL_TIMEOUT, reply
            assert trio.current_time() - started >= 0.5
            assert "0 of 16384 tokens free" in reply.message and "asks for 1000" in reply.message
            # A patient session waits in the queue (the record shows it) and gets in once the
            # first hog stops stepping and its lease lapses; that hog hears why.
            opened: list[Any] = []

            async def wait_in_queue() -> None:
                opened.append(await _open(node, daemon.peer_id, 1000, 30))

            nursery.start_soon(wait_in_queue)
            await trio.sleep(0.5)
            record = await _record(node, daemon.peer_id)
            assert (record.queued_sessions, record.free_cache_tokens) == (1, 0)
            assert not opened
            await hogs[0].stop()
            evicted = await first.receive(30)
            assert isinstance(evicted, wire.Error)
            assert evicted.code == wire.ErrorCode.LEASE_EXPIRED, evicted
            with trio.fail_after(30):
                while not opened:
                    await trio.sleep(0.1)
            await hogs[1].stop()
        assert isinstance(opened[0][1], wire.SessionOpened)
        for stream in (first, second, opened[0][0]):
            await stream.close()
        with trio.fail_after(10):
            while (await _record(node, daemon.peer_id)).free_cache_tokens != 16384:
                await trio.sleep(0.2)
