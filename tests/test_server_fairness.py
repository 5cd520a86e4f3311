"""A block server under hostile load (issue 17, review findings 5 and 7): cache is leased, not
held (idle or long-held sessions are ended for a request waiting for cache, one peer's share is
capped), and training shares the device with inference one slice at a time, within per-peer
quotas and a token cap derived from the measured speed. Pure trio with a MockClock where time
matters; real BlockServers over tests/memnet.py otherwise. Nothing here asserts on wall time."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
import trio
import trio.testing
from libp2p.peer.id import ID

import blocks
import wire
from blocks import MemoryCache
from peerd.node.p2p import INFERENCE_PROTOCOL, TRAINING_PROTOCOL
from peerd.node.streams import MessageStream
from peerd.server import training
from peerd.server.admission import Admission, Lease, Refused
from peerd.server.block_server import BlockServer, ServerLimits
from peerd.server.compute import PRIORITY_TRAINING, ComputeQueue
from peerd.session.inference import InferenceSession
from peerd.session.swarm import SwarmView
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, open_memnet, save_tiny_llama
from tests.numeric import assert_close_scaled

HIDDEN = 32
TIMEOUT_S = 30.0  # generous: nothing here waits for a deadline to pass
SAME = 1e-4  # block by block vs the whole span: the same operations, up to float rounding


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("fairness"))


# --- cache leases (pure trio, virtual time) -------------------------------------------------------


def _admission(**kwargs: float) -> Admission:
    return Admission(max_sessions_per_peer=64, max_inflight_bytes_per_peer=1 << 30, **kwargs)  # type: ignore[arg-type]


async def _hold(
    admission: Admission,
    cache: MemoryCache,
    peer: str,
    tokens: int,
    ended: dict[str, Refused],
    step_every: float | None = None,
    task_status: trio.TaskStatus[Lease] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A session of `peer` served as the server serves one: it holds its lease until evicted,
    stepping every `step_every` seconds (None: never)."""
    session = await admission.open_session(cache, 1, tokens, wait_s=60, peer=peer)
    with trio.CancelScope() as scope, admission.lease(peer, session.tokens) as lease, session:

        def evict(failure: Refused) -> None:
            ended[peer] = failure
            scope.cancel()

        lease.evict = evict
        task_status.started(lease)
        while True:
            if step_every is None:
                await trio.sleep_forever()
            await trio.sleep(step_every)
            with lease.step():
                await trio.sleep(0.01)  # the step computes


async def test_sessions_that_reserve_the_cache_and_never_step_lose_it_to_a_waiting_user(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Finding 5: two sessions of 8192 tokens that never step took the whole 16384-token cache
    and an honest session waited its whole 10 s in vain; now the idle ones go, as few as fit it."""
    cache = MemoryCache(budget_tokens=16384)
    admission = _admission()
    ended: dict[str, Refused] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(_hold, admission, cache, "hog-1", 8192, ended)
        await trio.sleep(1)
        await nursery.start(_hold, admission, cache, "hog-2", 8192, ended)
        await trio.sleep(1)
        asked = trio.current_time()
        honest = await admission.open_session(cache, 1, 1000, wait_s=10, peer="honest")
        # It got in once the first hog had been idle lease_idle_s, not after the 300 s hold.
        assert trio.current_time() - asked == pytest.approx(admission.lease_idle_s - 2)
        assert list(ended) == ["hog-1"]  # the longest idle; one is enough for 1000 tokens
        failure = ended["hog-1"]
        assert failure.code == wire.ErrorCode.LEASE_EXPIRED
        assert "sent no step for 5 s" in str(failure) and "replay" in str(failure)
        assert admission.evictions == 1
        honest.close()
        nursery.cancel_scope.cancel()


async def test_a_session_that_steps_now_and_then_cannot_hold_the_cache_past_its_term(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 1-token step every few seconds kept the hold forever; the lease term ends it when
    someone waits, so the request at the head of the queue waits at most lease_term_s."""
    cache = MemoryCache(budget_tokens=16384)
    admission = _admission()
    ended: dict[str, Refused] = {}
    async with trio.open_nursery() as nursery:
        opened = trio.current_time()
        for hog in ("hog-1", "hog-2"):
            await nursery.start(_hold, admission, cache, hog, 8192, ended, 1.0)
        await trio.sleep(3)
        honest = await admission.open_session(cache, 1, 8192, wait_s=60, peer="honest")
        assert trio.current_time() - opened == pytest.approx(admission.lease_term_s, abs=0.1)
        assert len(ended) == 1
        assert "held them for 30 s" in str(next(iter(ended.values())))
        honest.close()
        nursery.cancel_scope.cancel()


async def test_leases_cost_nothing_while_nobody_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=100)
    admission = _admission(max_cache_share=1.0)
    ended: dict[str, Refused] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(_hold, admission, cache, "quiet", 50, ended)
        await trio.sleep(250)  # idle far past the lease, but the cache has room for everyone
        (await admission.open_session(cache, 1, 50, wait_s=1, peer="other")).close()
        assert not ended and admission.evictions == 0
        # A request that all the lapsed leases together could not satisfy evicts nobody.
        await nursery.start(_hold, admission, cache, "busy", 50, ended, 1.0)
        with pytest.raises(Refused) as refused:
            await admission.open_session(cache, 1, 100, wait_s=5, peer="other")
        assert refused.value.code == wire.ErrorCode.CACHE_FULL_TIMEOUT
        assert not ended
        nursery.cancel_scope.cancel()


async def test_one_peer_may_hold_only_its_share_of_the_cache(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=16384)
    admission = _admission()
    ended: dict[str, Refused] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(_hold, admission, cache, "greedy", 8192, ended)
        with pytest.raises(Refused) as refused:
            await admission.open_session(cache, 1, 8192, wait_s=10, peer="greedy")
        assert refused.value.code == wire.ErrorCode.OUT_OF_CACHE
        assert "holds or waits for 8192" in str(refused.value)
        assert "past the 8192 one peer may hold (50%)" in str(refused.value)
        (await admission.open_session(cache, 1, 8192, wait_s=0, peer="someone else")).close()
        # One session alone may be longer than the share (else it could never be served).
        (await admission.open_session(MemoryCache(16384), 1, 12000, 0, peer="long")).close()
        nursery.cancel_scope.cancel()


# --- eviction seen by a real client over a memnet -------------------------------------------------


@pytest.fixture
async def leased_net(tiny_llama: Path) -> AsyncIterator[MemNet]:
    """head (0:3), and tail-1, tail-2 (3:6) whose 64-token caches lease at once when anyone
    waits (lease_idle_s 0) and may all go to one peer."""
    limits = ServerLimits(lease_idle_s=0.0, max_cache_share=1.0)
    async with open_memnet() as net:
        net.serve("head", blocks.load_span(tiny_llama, 0, 3))
        for name in ("tail-1", "tail-2"):
            net.serve(
                name, blocks.load_span(tiny_llama, 3, TINY_BLOCKS), cache_tokens=64, limits=limits
            )
        yield net


async def _open_raw(
    net: MemNet, who: str, server: str, max_length: int, start: int = 3, end: int = TINY_BLOCKS
) -> MessageStream:
    raw = await net.node(who).open_stream(ID.from_base58(net.peer_id(server)), INFERENCE_PROTOCOL)
    stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
    await stream.send(
        wire.OpenSession(
            session_id=uuid.uuid4().hex,
            model=TINY_MODEL,
            start=start,
            end=end,
            max_length=max_length,
            wait_timeout=TIMEOUT_S,
        )
    )
    return stream


async def test_an_evicted_session_hears_why_and_its_client_replays_elsewhere(
    leased_net: MemNet, tiny_llama: Path
) -> None:
    net = leased_net
    whole = blocks.load_span(tiny_llama, 0, TINY_BLOCKS)
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(1, n, HIDDEN, generator=g) for n in (5, 1, 1)]
    view = SwarmView(net.node("client"), TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]
    view.records = net.records()
    async with InferenceSession(view, max_length=32) as session:
        outputs = [await session.step(steps[0])]
        tail = next(n for n in ("tail-1", "tail-2") if net.peer_id(n) == session.hops[1].peer_id)
        server = net.server(tail)
        # Someone else asks for the whole cache of our tail server while we read the output.
        other = await _open_raw(net, "other", tail, 64)
        opened = await other.receive(TIMEOUT_S)
        assert isinstance(opened, wire.SessionOpened), opened
        assert server.admission.evictions == 1
        for hidden in steps[1:]:
            outputs.append(await session.step(hidden))
        # The client re-opened the blocks (on either tail server) and replayed the prompt.
        assert session.position == 7
        # Taking back an idle session's cache is no fault of the server: nobody is banned.
        assert session.route_keeper.lapsed == 1 and session.failures == 0
        assert not view.bans.banned(time.time()), view.bans.banned(time.time())
        await other.close()
    with torch.inference_mode():
        assert_close_scaled(torch.cat(outputs, dim=1), whole(torch.cat(steps, dim=1)))


async def test_a_client_evicted_on_its_first_hop_reopens_it_and_blames_nobody(
    tiny_llama: Path,
) -> None:
    """The first hop is the one the client sends to: its next step must reach the server and
    read the lease_expired answer, not fail on a closed stream (a fault that bans the server)."""
    limits = ServerLimits(lease_idle_s=0.0, max_cache_share=1.0)
    async with open_memnet() as net:
        for name in ("head-1", "head-2"):
            net.serve(name, blocks.load_span(tiny_llama, 0, 3), cache_tokens=64, limits=limits)
        net.serve("tail", blocks.load_span(tiny_llama, 3, TINY_BLOCKS))
        view = SwarmView(net.node("client"), TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]
        view.records = net.records()
        async with InferenceSession(view, max_length=32) as session:
            await session.step(_random(1, 5, HIDDEN, seed=8))
            head = session.hops[0].peer_id
            name = next(n for n in ("head-1", "head-2") if net.peer_id(n) == head)
            other = await _open_raw(net, "other", name, 64, start=0, end=3)
            assert isinstance(await other.receive(TIMEOUT_S), wire.SessionOpened)
            await session.step(_random(1, 1, HIDDEN, seed=9))
            assert session.position == 6
            assert view.bans.failures(head) == 0 and session.failures == 0
            await other.close()


async def test_the_record_counts_cache_held_by_lapsed_leases_as_free(leased_net: MemNet) -> None:
    """Routing skips a server whose record shows too little free cache, so an honest client never
    even queued at a server hogged by idle sessions ("out of cache" after 32 s)."""
    server = leased_net.server("tail-1")
    held = await _open_raw(leased_net, "hog", "tail-1", 64)
    assert isinstance(await held.receive(TIMEOUT_S), wire.SessionOpened)
    assert server.cache is not None and server.cache.free_tokens == 0
    # Idle (lease_idle_s is 0 here): all 64 tokens are there for whoever asks.
    assert server.record().free_cache_tokens == 64
    await held.close()


async def test_an_evicted_session_gets_a_typed_error_on_its_stream(leased_net: MemNet) -> None:
    held = await _open_raw(leased_net, "someone", "tail-1", 32)
    assert isinstance(await held.receive(TIMEOUT_S), wire.SessionOpened)
    waiting = await _open_raw(leased_net, "other", "tail-1", 64)
    error = await held.receive(TIMEOUT_S)
    assert isinstance(error, wire.Error) and error.code == wire.ErrorCode.LEASE_EXPIRED
    assert "open a new session" in error.message
    assert isinstance(await waiting.receive(TIMEOUT_S), wire.SessionOpened)
    await waiting.close()


# --- training: slices, quotas, a token cap --------------------------------------------------------


@pytest.fixture
def server(tiny_llama: Path) -> BlockServer:
    span = blocks.load_span(tiny_llama, 0, 4)
    server = BlockServer(
        model=span.model,
        start=0,
        end=4,
        compute=ComputeQueue(),
        peer_id="12D3KooWtest",
        addrs=lambda: [],
    )
    server.go_online(span, blocks.MemoryCache(budget_tokens=1024), throughput=1.0)
    return server


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shared_prompts", [True, False])
async def test_a_training_pass_runs_one_block_and_row_group_per_job_and_matches_the_span(
    server: BlockServer, shared_prompts: bool
) -> None:
    assert server.span is not None
    rows, tokens = 3, training.SLICE_TOKENS // 2  # two rows a slice: groups of rows 0:2 and 2:3
    hidden, grad_out = _random(rows, tokens, HIDDEN, seed=1), _random(rows, tokens, HIDDEN, seed=2)
    prompts = _random(4, 1 if shared_prompts else rows, 3, HIDDEN, seed=3)
    common = {"model": server.model, "start": 0, "end": 4, "hidden_states": hidden}
    forward = await server.run_training(wire.Forward(**common, prompts=prompts))
    assert isinstance(forward, wire.ForwardResult)
    assert server.counters.training_slices == 4 * 2  # blocks x row groups
    with torch.no_grad():
        assert_close_scaled(forward.hidden_states, server.span(hidden, prompts=prompts), rel=SAME)
    back = await server.run_training(
        wire.Backward(**common, grad_outputs=grad_out, prompts=prompts)
    )
    assert isinstance(back, wire.BackwardResult)
    assert server.counters.training_slices == 8 + 2 * 4 * 2  # a forward and a backward per block
    x, p = hidden.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    server.span(x, prompts=p).backward(grad_out)
    assert x.grad is not None and p.grad is not None and back.grad_prompts is not None
    assert_close_scaled(back.grad_inputs, x.grad, rel=SAME)
    assert_close_scaled(back.grad_prompts, p.grad, rel=SAME)


@pytest.fixture
def gates() -> Iterator[list[threading.Event]]:
    events: list[threading.Event] = []
    yield events
    for event in events:
        event.set()  # never leave a worker thread blocked


async def _hold_device(
    nursery: trio.Nursery, server: BlockServer, gates: list[threading.Event]
) -> tuple[threading.Event, threading.Event]:
    """Queue a training-priority job that holds the device until released: (started, release)."""
    started, release = threading.Event(), threading.Event()
    gates.append(release)

    def hold() -> None:
        started.set()
        release.wait(TIMEOUT_S)

    nursery.start_soon(server.compute.run, PRIORITY_TRAINING, hold)
    await trio.sleep(0)
    return started, release


async def _until(condition: object) -> None:
    with trio.fail_after(TIMEOUT_S):
        while not condition():  # type: ignore[operator]
            await trio.sleep(0.001)


async def test_an_inference_step_waits_for_one_training_slice_not_the_whole_pass(
    server: BlockServer, gates: list[threading.Event]
) -> None:
    """Finding 7: a 4096-token training forward held the single compute worker ~10 s and a
    concurrent generate went from 2.3 s to 20.8 s. Now a step overtakes the pass between two of
    its slices: the order of jobs is pinned with jobs that hold the device, not with timings."""
    forward = wire.Forward(
        model=server.model, start=0, end=4, hidden_states=_random(1, 64, HIDDEN, seed=5)
    )
    local = server.open_local(
        wire.OpenSession(session_id="s", model=server.model, start=0, end=4, max_length=8)
    )
    done: list[str] = []

    async def train() -> None:
        await server.run_training(forward)
        done.append("training")

    async def infer() -> None:
        await local.step(_random(1, 1, HIDDEN, seed=6), None)
        done.append("inference")

    async with trio.open_nursery() as nursery:
        first, release_first = await _hold_device(nursery, server, gates)
        await _until(first.is_set)
        nursery.start_soon(train)  # its first slice queues behind the held device
        await _until(lambda: server.compute.depth == 2)
        # Next in line after the training's first slice: a second holder.
        second, release_second = await _hold_device(nursery, server, gates)
        release_first.set()
        await _until(second.is_set)  # the first slice ran; the device is held again
        nursery.start_soon(infer)
        await _until(lambda: server.compute.depth == 3)  # holder, inference, the next slice
        release_second.set()
    assert done == ["inference", "training"]
    local.close()


async def test_training_requests_have_a_per_peer_quota_and_other_peers_go_on(
    tiny_llama: Path, gates: list[threading.Event]
) -> None:
    async with open_memnet() as net:
        server = net.serve("a", blocks.load_span(tiny_llama, 0, 3))
        request = wire.Forward(
            model=TINY_MODEL, start=0, end=3, hidden_states=_random(1, 4, HIDDEN, seed=7)
        )

        async def stream_of(who: str) -> MessageStream:
            raw = await net.node(who).open_stream(
                ID.from_base58(net.peer_id("a")), TRAINING_PROTOCOL
            )
            return MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)

        async with trio.open_nursery() as nursery:
            started, release = await _hold_device(nursery, server, gates)
            await _until(started.is_set)
            heavy = [await stream_of("heavy") for _ in range(3)]
            for stream in heavy[:2]:
                await stream.send(request)
            await _until(lambda: server.admission.training_of(net.peer_id("heavy")) == 2)
            await heavy[2].send(request)
            refused = await heavy[2].receive(TIMEOUT_S)
            assert isinstance(refused, wire.Error) and refused.code == wire.ErrorCode.INFLIGHT_LIMIT
            assert "already has 2 training requests" in refused.message
            light = await stream_of("light")
            await light.send(request)
            release.set()
            for stream in (*heavy[:2], light):
                assert isinstance(await stream.receive(TIMEOUT_S), wire.ForwardResult)
            await heavy[2].send(request)  # the refused stream goes on, within the quota now
            assert isinstance(await heavy[2].receive(TIMEOUT_S), wire.ForwardResult)


async def test_the_training_token_cap_follows_the_measured_speed(server: BlockServer) -> None:
    """An 8192-token backward could outlast a client's pass timeout; the cap keeps it within
    PASS_BUDGET_S at the speed the server measured on its own slices."""
    pace = training.TrainingPace()
    assert pace.max_tokens(4, 8192) == 8192  # nothing measured: the configured limit
    pace.observe(tokens=100, forwards=1.0, seconds=10.0)  # mostly overhead: not counted
    assert pace.max_tokens(4, 8192) == 8192
    pace.observe(tokens=1000, forwards=4.0, seconds=1.0)  # 4000 token-blocks of forward a second
    # A backward over 10 blocks costs 4 forwards: 24 s x 4000 / (4 x 10) = 2400 tokens.
    assert pace.max_tokens(10, 8192) == 2400
    assert pace.max_tokens(30, 8192) == 800
    assert pace.max_tokens(10_000, 8192) == training.MIN_TRAINING_TOKENS

    server.training_pace.observe(tokens=400, forwards=training.BACKWARD_COST, seconds=60.0)
    with pytest.raises(wire.ProtocolError) as refused:
        await server.run_training(
            wire.Forward(
                model=server.model, start=0, end=4, hidden_states=torch.zeros(2, 200, HIDDEN)
            )
        )
    assert "limit of 256 per training request over 4 blocks" in str(refused.value)
    assert "measured speed" in str(refused.value)
