"""Who may push into a session, and what a client makes of a step result it never asked for.

A pushed step is taken only from the session's named upstream (the peer id its push stream
proved) carrying the session's push token; the client draws a fresh token per hop and hands it
only in the NextHop naming that hop. A result for a step the client never sent, on a session
its upstream may push into, is nobody's proven fault: the client moves that hop without banning
anyone. The conversation rules first (messages alone), then against real BlockServers in one
process (tests/memnet.py), each output compared with the whole model run in one piece."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
from libp2p.peer.id import ID

import blocks
import wire
from peerd.node.p2p import INFERENCE_PROTOCOL, PUSH_PROTOCOL
from peerd.node.streams import MessageStream, PeerGone
from peerd.session.hops import HopSession
from peerd.session.inference import InferenceSession
from tests.memnet import (
    TINY_MODEL,
    MemNet,
    open_memnet,
    random_steps,
    view_over,
    whole_output,
)
from tests.numeric import assert_close_scaled
from wire.conversation import (
    BadReply,
    ClientInference,
    Opened,
    PushRefused,
    ServerInference,
    StepDone,
    UnexpectedReply,
    Unsolicited,
)

UPSTREAM = "12D3KooWUpstream"
TOKEN = "0123456789abcdef0123456789abcdef"
HIDDEN = 32  # the tiny llama's hidden size


def _open(**fields: object) -> wire.OpenSession:
    values: dict[str, object] = dict(session_id="s", model="m", start=0, end=2, max_length=8)
    values.update(fields)
    return wire.OpenSession(**values)  # type: ignore[arg-type]


def _step(step_id: int, token: str | None = None) -> wire.Step:
    return wire.Step(
        session_id="s", step_id=step_id, hidden_states=torch.zeros(1, 1, 4), push_token=token
    )


def _server(**fields: object) -> ServerInference:
    conv = ServerInference()
    conv.receive(_open(**fields))
    conv.opened(8)
    return conv


def _client(**fields: object) -> ClientInference:
    conv = ClientInference(_open(**fields))
    assert isinstance(conv.received(wire.SessionOpened(session_id="s", max_length=8)), Opened)
    return conv


def _result(step_id: int, hidden: torch.Tensor | None = None) -> wire.StepResult:
    hidden = torch.zeros(1, 1, 4) if hidden is None else hidden
    return wire.StepResult(session_id="s", step_id=step_id, hidden_states=hidden)


# --- the rules ----------------------------------------------------------------------------------


def test_a_push_needs_the_named_upstream_and_the_sessions_token() -> None:
    conv = _server(upstream=UPSTREAM, push_token=TOKEN)
    with pytest.raises(PushRefused, match="push token"):
        conv.receive_pushed(_step(0), sender=UPSTREAM)  # no token
    with pytest.raises(PushRefused, match="push token"):
        conv.receive_pushed(_step(0, TOKEN[:-1] + "0"), sender=UPSTREAM)  # a near miss
    with pytest.raises(PushRefused, match="only from"):
        conv.receive_pushed(_step(0, TOKEN), sender="12D3KooWStranger")  # token, not the peer
    event = conv.receive_pushed(_step(0, TOKEN), sender=UPSTREAM)
    assert event.pushed and conv.start_step(event.step, pushed=True)


def test_a_session_with_a_token_and_no_upstream_takes_no_push_without_the_token() -> None:
    """What a client sends for its first hop and its spot-check sessions: a token it gives to
    nobody, so nobody can push there."""
    conv = _server(push_token=TOKEN)
    with pytest.raises(PushRefused, match="push token"):
        conv.receive_pushed(_step(0), sender="12D3KooWAnyone")


def test_a_reply_to_a_step_never_sent_is_unsolicited_only_where_pushes_may_come() -> None:
    pushed_into = _client(upstream=UPSTREAM, push_token=TOKEN)
    pushed_into.sent_step(0, (1, 1, 4))
    assert isinstance(pushed_into.received(_result(9)), Unsolicited)
    assert isinstance(pushed_into.received(_result(0)), StepDone)  # still ours to read
    alone = _client(push_token=TOKEN)
    alone.sent_step(0, (1, 1, 4))
    with pytest.raises(UnexpectedReply, match="never sent"):
        alone.received(_result(9))


@pytest.mark.parametrize(
    "hidden",
    [torch.zeros(1, 1, 3), torch.zeros(1, 2, 4), torch.zeros(2, 1, 4)],
    ids=["width", "tokens", "batch"],
)
def test_a_reply_of_another_shape_than_its_steps_input_is_bad(hidden: torch.Tensor) -> None:
    conv = _client()
    conv.sent_step(0, (1, 1, 4))
    with pytest.raises(BadReply, match="shape"):
        conv.received(_result(0, hidden))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_reply_with_values_that_are_not_finite_is_bad(value: float) -> None:
    conv = _client()
    conv.sent_step(0, (1, 2, 4))
    result = _result(0, torch.zeros(1, 2, 4))
    # Set after the record is made (wire refuses NaN at the door too; the client holds the
    # line itself, whatever a decoder lets through).
    result.hidden_states[0, 1, 2] = value
    with pytest.raises(BadReply, match="not finite"):
        conv.received(result)


def test_a_reply_in_another_dtype_must_be_finite_in_the_steps_dtype() -> None:
    conv = _client()
    conv.sent_step(0, (1, 1, 4), torch.float32)
    assert isinstance(conv.received(_result(0, torch.ones(1, 1, 4, dtype=torch.float64))), StepDone)
    conv.sent_step(1, (1, 1, 4), torch.float32)
    huge = torch.ones(1, 1, 4, dtype=torch.float64)
    huge[0, 0, 1] = 1e300  # finite as sent, inf once in float32
    with pytest.raises(BadReply, match="not finite"):
        conv.received(_result(1, huge))


# --- against real servers -----------------------------------------------------------------------


async def _push_as(net: MemNet, name: str, target: HopSession, token: str | None) -> None:
    """Push a garbage step into `target`'s session from node `name` (the server of that name
    when there is one: the same peer id), with `token`, starting at position 0 (overwriting the
    cache) and a step id far past any of the session's; return once the server dealt with it
    (closed the push stream, or ran the step)."""
    raw = await net.node(name).open_stream(ID.from_base58(target.peer_id), PUSH_PROTOCOL)
    stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
    server = next(net.server(n) for n in ("head", "tail") if net.peer_id(n) == target.peer_id)
    steps_before = server.counters.steps
    spoof = wire.Step(
        session_id=target.session_id,
        step_id=1 << 40,
        hidden_states=torch.randn(1, 1, HIDDEN),
        start_position=0,
        push_token=token,
    )
    await stream.send(spoof)
    closed = trio.Event()

    async def wait_closed() -> None:
        try:
            await stream.receive(60)
        except PeerGone:
            closed.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_closed)
            while not closed.is_set() and server.counters.steps == steps_before:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("token", ["none", "wrong"])
async def test_the_named_upstream_without_the_token_cannot_push(
    tiny_llama: Path, whole: blocks.Span, token: str
) -> None:
    """The previous hop's own peer id is not enough: without the session's token its push is
    refused, and the session goes on untouched (no failure, no move, the right output)."""
    steps = random_steps(7, (4, 1, 1))
    reference = whole_output(whole, steps)
    async with open_memnet() as net:
        for name, (start, end) in {"head": (0, 3), "tail": (3, 6)}.items():
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        view = view_over(net)
        async with InferenceSession(view, max_length=16) as session:
            outputs = [await session.step(steps[0])]
            head, tail = session.hops
            assert isinstance(tail, HopSession) and tail.upstream == head.peer_id
            await _push_as(net, "head", tail, None if token == "none" else "f" * 32)
            outputs += [await session.step(hidden) for hidden in steps[1:]]
            assert session.failures == 0 and session.route_keeper.unattributed == 0
            assert session.hops[1] is tail
            assert view.bans.failures(tail.peer_id) == 0
    assert_close_scaled(torch.cat(outputs, dim=1), reference)


async def test_a_push_by_the_upstream_itself_bans_no_honest_server(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """The upstream holds the token (it must, to push): a step it pushes that the client never
    sent overwrites the next hop's cache and draws a result the client never asked for. The
    client cannot tell which of the two lied, so it bans neither: it moves the next hop (the
    cache replayed from its own record) and relays from then on."""
    steps = random_steps(8, (4, 1, 1, 1))
    reference = whole_output(whole, steps)
    async with open_memnet() as net:
        for name, (start, end) in {"head": (0, 3), "tail": (3, 6)}.items():
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        view = view_over(net)
        async with InferenceSession(view, max_length=16) as session:
            outputs = [await session.step(steps[0])]
            tail = session.hops[1]
            assert isinstance(tail, HopSession)
            await _push_as(net, "head", tail, tail.conversation.request.push_token)
            with trio.fail_after(30):
                outputs += [await session.step(hidden) for hidden in steps[1:]]
            assert session.failures == 0 and session.route_keeper.unattributed == 1
            assert session.hops[1] is not tail and not session.route_keeper.pushing
            for name in ("head", "tail"):
                assert view.bans.failures(net.peer_id(name)) == 0
                assert net.peer_id(name) in view.records
    assert_close_scaled(torch.cat(outputs, dim=1), reference)


async def test_every_hop_gets_its_own_token_carried_by_the_next_hop_naming_it(
    tiny_llama: Path,
) -> None:
    async with open_memnet() as net:
        for name, (start, end) in {"head": (0, 3), "tail": (3, 6)}.items():
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        async with InferenceSession(view_over(net), max_length=16) as session:
            head, tail = session.hops
            assert isinstance(head, HopSession) and isinstance(tail, HopSession)
            tokens = [h.conversation.request.push_token for h in (head, tail)]
            assert all(t is not None and len(t) == 32 for t in tokens)
            assert tokens[0] != tokens[1]
            assert tail.as_next_hop().push_token == tokens[1]


async def test_a_session_id_that_is_open_already_cannot_be_taken_over(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """The head learns the tail's session id (next_hops). Opening its own session under that id
    (naming no upstream, so no token would be asked of its pushes) would have replaced the
    victim's session and taken the steps pushed into it: it is refused, the victim goes on."""
    steps = random_steps(9, (4, 1))
    reference = whole_output(whole, steps)
    async with open_memnet() as net:
        for name, (start, end) in {"head": (0, 3), "tail": (3, 6)}.items():
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        view = view_over(net)
        async with InferenceSession(view, max_length=16) as session:
            outputs = [await session.step(steps[0])]
            tail = session.hops[1]
            assert isinstance(tail, HopSession)
            raw = await net.node("head").open_stream(
                ID.from_base58(tail.peer_id), INFERENCE_PROTOCOL
            )
            stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
            await stream.send(
                wire.OpenSession(
                    session_id=tail.session_id, model=TINY_MODEL, start=3, end=6, max_length=16
                )
            )
            reply = await stream.receive(30)
            assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BAD_REQUEST
            assert "open already" in reply.message
            outputs.append(await session.step(steps[1]))
            assert session.failures == 0 and session.route_keeper.unattributed == 0
    assert_close_scaled(torch.cat(outputs, dim=1), reference)
