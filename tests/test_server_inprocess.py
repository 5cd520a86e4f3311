"""The block server's protocols in one process over tests/memnet.py: a route of two in-process
servers answers what the whole span answers, step order and push-only-from-upstream are enforced
per session, and a bug while handling one stream ends that stream with Error(internal) while the
server serves on."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
import trio
from libp2p.peer.id import ID

import blocks
import wire
from peerd.node.p2p import INFERENCE_PROTOCOL, INFO_PROTOCOL, PUSH_PROTOCOL, TRAINING_PROTOCOL
from peerd.node.streams import Idle, MessageStream, PeerGone
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, MemNode, open_memnet, save_tiny_llama

HIDDEN = 32
TIMEOUT_S = 30.0  # generous: a loaded CI machine; nothing here waits for a deadline to pass


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("memnet"))


@pytest.fixture
async def net(tiny_llama: Path) -> AsyncIterator[MemNet]:
    """Servers a (blocks 0:3) and b (3:6) of the tiny llama."""
    async with open_memnet() as net:
        net.serve("a", blocks.load_span(tiny_llama, 0, 3))
        net.serve("b", blocks.load_span(tiny_llama, 3, TINY_BLOCKS))
        yield net


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float noise that scales with the values (a real bug is off by far more)."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


async def _assert_ended(stream: MessageStream) -> None:
    """The other side closed `stream` (not merely went quiet)."""
    with pytest.raises(PeerGone) as gone:
        await stream.receive(TIMEOUT_S)
    assert not isinstance(gone.value, Idle), gone.value


async def _open(
    node: MemNode, net: MemNet, name: str, start: int, end: int, **fields: object
) -> tuple[MessageStream, str]:
    """An open inference session on server `name`: (its stream, its session id)."""
    raw = await node.open_stream(ID.from_base58(net.peer_id(name)), INFERENCE_PROTOCOL)
    stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
    session_id = uuid.uuid4().hex
    await stream.send(
        wire.OpenSession(
            session_id=session_id, model=TINY_MODEL, start=start, end=end, max_length=64, **fields
        )
    )
    reply = await stream.receive(TIMEOUT_S)
    assert isinstance(reply, wire.SessionOpened), reply
    return stream, session_id


async def _step(
    stream: MessageStream, session_id: str, step_id: int, hidden: torch.Tensor
) -> wire.Message:
    await stream.send(wire.Step(session_id=session_id, step_id=step_id, hidden_states=hidden))
    return await stream.receive(TIMEOUT_S)


async def test_a_two_server_route_answers_what_the_whole_span_answers(
    net: MemNet, tiny_llama: Path
) -> None:
    whole = blocks.load_span(tiny_llama, 0, TINY_BLOCKS)
    reference = blocks.MemoryCache(budget_tokens=1000).open_session(1, 64)
    client = net.node("client")
    a, a_id = await _open(client, net, "a", 0, 3)
    b, b_id = await _open(client, net, "b", 3, TINY_BLOCKS)
    torch.manual_seed(0)
    for step_id, tokens in enumerate([5, 1, 1]):  # a prefill, then two decode steps
        hidden = torch.randn(1, tokens, HIDDEN)
        want = whole(hidden, reference)
        middle = await _step(a, a_id, step_id, hidden)
        assert isinstance(middle, wire.StepResult) and middle.step_id == step_id
        out = await _step(b, b_id, step_id, middle.hidden_states)
        assert isinstance(out, wire.StepResult)
        _close(out.hidden_states, want)


async def test_a_pushed_step_reaches_the_next_server_and_both_answer(
    net: MemNet, tiny_llama: Path
) -> None:
    whole = blocks.load_span(tiny_llama, 0, TINY_BLOCKS)
    client = net.node("client")
    a, a_id = await _open(client, net, "a", 0, 3)
    b, b_id = await _open(client, net, "b", 3, TINY_BLOCKS, upstream=net.peer_id("a"))
    hidden = torch.randn(1, 4, HIDDEN)
    hop = wire.NextHop(peer_id=net.peer_id("b"), session_id=b_id, start=3, end=TINY_BLOCKS)
    await a.send(wire.Step(session_id=a_id, step_id=0, hidden_states=hidden, next_hops=(hop,)))
    first = await a.receive(TIMEOUT_S)
    assert isinstance(first, wire.StepResult) and not first.push_failed
    second = await b.receive(TIMEOUT_S)
    assert isinstance(second, wire.StepResult) and second.step_id == 0
    with blocks.MemoryCache(budget_tokens=1000).open_session(1, 64) as reference:
        _close(second.hidden_states, whole(hidden, reference))


async def test_info_over_memnet_gives_the_live_record(net: MemNet) -> None:
    raw = await net.node("client").open_stream(ID.from_base58(net.peer_id("b")), INFO_PROTOCOL)
    stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
    await stream.send(wire.InfoRequest())
    reply = await stream.receive_as(wire.InfoResponse, TIMEOUT_S)
    assert (reply.record.start, reply.record.end) == (3, TINY_BLOCKS)
    assert reply.record.peer_id == net.peer_id("b")


async def test_a_killed_server_ends_its_streams_and_cannot_be_reached(net: MemNet) -> None:
    client = net.node("client")
    a, a_id = await _open(client, net, "a", 0, 3)
    net.kill("a")
    with pytest.raises(PeerGone):
        await _step(a, a_id, 0, torch.randn(1, 1, HIDDEN))
    with pytest.raises(ConnectionError):
        await client.open_stream(ID.from_base58(net.peer_id("a")), INFERENCE_PROTOCOL)
    assert set(net.records()) == {net.peer_id("b")}


async def test_an_out_of_order_step_ends_its_session_only(net: MemNet) -> None:
    client = net.node("client")
    a, a_id = await _open(client, net, "a", 0, 3)
    assert isinstance(await _step(a, a_id, 4, torch.randn(1, 2, HIDDEN)), wire.StepResult)
    reply = await _step(a, a_id, 4, torch.randn(1, 1, HIDDEN))  # the same id again
    assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BAD_REQUEST
    assert "step 4 after step 4" in reply.message
    await _assert_ended(a)  # the session's stream ended
    again, again_id = await _open(client, net, "a", 0, 3)  # the server serves on
    assert isinstance(await _step(again, again_id, 0, torch.randn(1, 1, HIDDEN)), wire.StepResult)
    assert net.server("a").open_sessions == 1


async def test_a_push_from_a_peer_other_than_the_named_upstream_is_refused(
    net: MemNet, tiny_llama: Path
) -> None:
    """A stranger who learnt b's session id pushes a step into it: its push stream is closed,
    and the session's cache and stream are untouched (no result the client never asked for)."""
    client = net.node("client")
    a, a_id = await _open(client, net, "a", 0, 3)
    b, b_id = await _open(client, net, "b", 3, TINY_BLOCKS, upstream=net.peer_id("a"))
    stranger = net.node("stranger")
    raw = await stranger.open_stream(ID.from_base58(net.peer_id("b")), PUSH_PROTOCOL)
    spoof = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
    await spoof.send(wire.Step(session_id=b_id, step_id=0, hidden_states=torch.randn(1, 5, HIDDEN)))
    await _assert_ended(spoof)  # refused: b closed the stranger's push stream
    # The client's own step through a, pushed on to b, runs on a cache the stranger never touched.
    hidden = torch.randn(1, 3, HIDDEN)
    hop = wire.NextHop(peer_id=net.peer_id("b"), session_id=b_id, start=3, end=TINY_BLOCKS)
    await a.send(wire.Step(session_id=a_id, step_id=1, hidden_states=hidden, next_hops=(hop,)))
    assert isinstance(await a.receive(TIMEOUT_S), wire.StepResult)
    got = await b.receive(TIMEOUT_S)
    assert isinstance(got, wire.StepResult) and got.step_id == 1
    whole = blocks.load_span(tiny_llama, 0, TINY_BLOCKS)
    with blocks.MemoryCache(budget_tokens=1000).open_session(1, 64) as reference:
        _close(got.hidden_states, whole(hidden, reference))


async def test_a_bug_while_serving_a_session_answers_internal_and_the_server_serves_on(
    net: MemNet, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = net.server("a")
    client = net.node("client")
    a, a_id = await _open(client, net, "a", 0, 3)

    async def planted_bug(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("planted bug")

    with monkeypatch.context() as patch:
        patch.setattr(server.batcher, "run", planted_bug)
        reply = await _step(a, a_id, 0, torch.randn(1, 2, HIDDEN))
    assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.INTERNAL
    await _assert_ended(a)
    logged = [r for r in caplog.records if r.exc_info and "planted bug" in str(r.exc_info[1])]
    assert logged and "bug while handling a inference stream" in logged[0].getMessage()
    assert server.counters.errors[wire.ErrorCode.INTERNAL] == 1
    assert server.open_sessions == 0 and server.cache is not None
    assert server.cache.free_tokens == 4096  # the broken session's cache is freed
    again, again_id = await _open(client, net, "a", 0, 3)
    assert isinstance(await _step(again, again_id, 0, torch.randn(1, 2, HIDDEN)), wire.StepResult)


async def test_a_bug_in_a_training_request_answers_internal(
    net: MemNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = net.server("b")
    raw = await net.node("client").open_stream(ID.from_base58(server.peer_id), TRAINING_PROTOCOL)
    stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
    forward = wire.Forward(
        model=TINY_MODEL, start=3, end=TINY_BLOCKS, hidden_states=torch.randn(1, 2, HIDDEN)
    )

    async def planted_bug(*args: object) -> torch.Tensor:
        raise KeyError("planted bug")

    with monkeypatch.context() as patch:
        patch.setattr(server.compute, "run", planted_bug)
        await stream.send(forward)
        reply = await stream.receive(TIMEOUT_S)
    assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.INTERNAL
    with trio.fail_after(TIMEOUT_S):  # the next stream is served as usual
        raw = await net.node("client").open_stream(
            ID.from_base58(server.peer_id), TRAINING_PROTOCOL
        )
        stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
        await stream.send(forward)
        assert isinstance(await stream.receive(TIMEOUT_S), wire.ForwardResult)
