"""Steps pushed into a session before it opened here (peerd.server.push.PushReceiver): held for
it, within bounds that a peer pushing into sessions that never open can neither stretch nor
fill for the others."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

import wire
from peerd.node.streams import MessageStream
from peerd.server import push
from peerd.server.push import EARLY_PUSH_WAIT_S, EARLY_PUSHES, PushReceiver
from peerd.server.sessions import InferenceHandler
from tests.memnet import stream_pair
from wire.conversation import PushRefused


class _Server:
    async def refuse(self, messages: MessageStream, code: wire.ErrorCode, text: str) -> None:
        pass


class _Live:
    def __init__(self) -> None:
        self.taken: list[tuple[wire.Step, str]] = []

    def take_pushed(self, step: wire.Step, sender: str) -> None:
        self.taken.append((step, sender))


def _step(session: str, values: int = 8) -> wire.Step:
    return wire.Step(session_id=session, step_id=0, hidden_states=torch.ones(1, 1, values))


async def _push(receiver: PushReceiver, steps: list[wire.Step], sender: str = "up") -> None:
    """Push `steps` to `receiver` on one stream from `sender`, until it handled them all."""
    ours, theirs = stream_pair(sender, "server")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver.handle, MessageStream(theirs, 1 << 24))
        stream = MessageStream(ours, 1 << 24)
        for step in steps:
            await stream.send(step)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()


async def test_a_step_pushed_before_its_session_opened_waits_for_it() -> None:
    live: dict[str, _Live] = {}
    receiver = PushReceiver(_Server(), live)
    await _push(receiver, [_step("s1")])
    claimed = receiver.claim("s1")
    assert claimed is not None and claimed[1] == "up"
    assert receiver.claim("s1") is None  # taken once
    live["s2"] = _Live()
    await _push(receiver, [_step("s2")])  # an open session takes it at once
    assert len(live["s2"].taken) == 1 and receiver.claim("s2") is None


async def test_early_pushes_are_bounded_oldest_dropped_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    receiver = PushReceiver(_Server(), {})
    mine = EARLY_PUSHES // 4  # what one pushing peer may have held
    await _push(receiver, [_step(f"x{i}") for i in range(mine + 2)], sender="flooder")
    assert receiver.claim("x0") is None and receiver.claim("x1") is None  # its own go first
    # Peers up to the limit in all: then the oldest of anyone's goes.
    for peer in range(4):
        await _push(receiver, [_step(f"p{peer}.{i}") for i in range(mine)], sender=f"p{peer}")
    assert all(receiver.claim(f"p{p}.{i}") is not None for p in range(4) for i in range(mine))
    assert all(receiver.claim(f"x{i}") is None for i in range(2, mine + 2))  # the oldest
    # A flood from one peer never crowds out another's.
    await _push(receiver, [_step("legit")], sender="server")
    await _push(receiver, [_step(f"y{i}") for i in range(4 * EARLY_PUSHES)], sender="flooder")
    assert receiver.claim("legit") is not None
    # By bytes too: a step over a peer's share is not held; room is made by age.
    monkeypatch.setattr(push, "EARLY_PUSH_BYTES", 4 * 100 * 4)  # a peer's share: 100 floats
    await _push(receiver, [_step("big", 101), _step("a", 60), _step("b", 60)])
    assert receiver.claim("big") is None and receiver.claim("a") is None
    assert receiver.claim("b") is not None
    # One per session: a second step for a session that has one waiting is dropped.
    await _push(receiver, [_step("c"), _step("c", 4)])
    claimed = receiver.claim("c")
    assert claimed is not None and claimed[0].hidden_states.shape[-1] == 8


async def test_an_early_push_expires_unless_its_session_is_opening(
    autojump_clock: trio.testing.MockClock,
) -> None:
    receiver = PushReceiver(_Server(), {})
    with receiver.opening("waiting"):  # its OpenSession came: it waits for cache
        await _push(receiver, [_step("waiting"), _step("gone")])
        await trio.sleep(EARLY_PUSH_WAIT_S + 1)
        await _push(receiver, [_step("new")])  # (expired ones go as a new one comes)
        assert receiver.claim("gone") is None
        assert receiver.claim("waiting") is not None
        await _push(receiver, [_step("waiting")])
    assert receiver.claim("waiting") is None  # refused or never claimed: dropped with it
    assert receiver.claim("new") is not None


async def test_a_session_drops_an_early_push_it_does_not_take_and_stays_open() -> None:
    """A held step from a peer the session does not take pushes from (or without its token) is
    refused as the session opens, as it would have been had it come later; the session lives."""
    handler = InferenceHandler(_Server(), None)  # type: ignore[arg-type]
    await _push(handler.pushes, [_step("s1")], sender="stranger")

    class _Refusing(_Live):
        request = wire.OpenSession(session_id="s1", model="m", start=0, end=1, max_length=8)

        def take_pushed(self, step: wire.Step, sender: str) -> None:
            raise PushRefused(f"no pushes from {sender}")

    handler._take_early_push(_Refusing())  # type: ignore[arg-type]
    assert handler.pushes.claim("s1") is None


def _request(
    session: str, upstream: str | None = "up", token: str | None = "t"
) -> wire.OpenSession:
    return wire.OpenSession(
        session_id=session,
        model="m",
        start=0,
        end=1,
        max_length=8,
        upstream=upstream,
        push_token=token,
    )


def _tokened(session: str, step_id: int = 3, values: int = 8) -> wire.Step:
    hidden = torch.ones(1, 1, values)
    return wire.Step(session_id=session, step_id=step_id, hidden_states=hidden, push_token="t")


async def test_a_dropped_early_push_is_named_to_its_session_as_it_opens(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A held step dropped (for room, too large, too early) is remembered without its tensor:
    its session, opening later, learns the step id, if the step came from its upstream with its
    token, once; within DROPPED_MEMORY_S and DROPPED_REMEMBERED."""
    receiver = PushReceiver(_Server(), {})
    mine = EARLY_PUSHES // 4
    await _push(receiver, [_tokened(f"x{i}", step_id=i) for i in range(mine + 1)])
    assert receiver.lost(_request("x0")) == 0  # dropped for room
    assert receiver.lost(_request("x0")) is None  # told once
    assert receiver.lost(_request("x1")) is None  # still held: claimed, not lost
    # Only for the session's upstream, with its token.
    for name, request, told in [
        ("y", _request("y0"), None),  # the stranger is not its upstream
        ("v", _request("v0", upstream="stranger", token="other"), None),
        ("w", _request("w0", upstream=None), None),  # takes no pushes at all
        ("u", _request("u0", upstream="stranger"), 3),
        ("t", _request("t0", upstream="stranger", token="ü"), None),  # not ASCII: no match
    ]:
        await _push(receiver, [_tokened(f"{name}{i}") for i in range(mine + 1)], sender="stranger")
        assert receiver.lost(request) == told
    # Too large to hold, and too early: remembered alike, for DROPPED_MEMORY_S.
    monkeypatch.setattr(push, "EARLY_PUSH_BYTES", 4 * 100 * 4)
    await _push(receiver, [_tokened("big", values=101), _tokened("early")])
    await trio.sleep(EARLY_PUSH_WAIT_S + 1)
    await _push(receiver, [_tokened("later")])  # (expired ones go as a new one comes)
    assert receiver.claim("early") is None and receiver.lost(_request("early")) == 3
    await trio.sleep(push.DROPPED_MEMORY_S)
    assert receiver.lost(_request("big")) is None  # forgotten
    # At most DROPPED_REMEMBERED, the oldest forgotten first.
    monkeypatch.setattr(push, "DROPPED_REMEMBERED", 2)
    await _push(receiver, [_tokened(name, values=101) for name in ("a", "b", "c")])
    assert [receiver.lost(_request(name)) for name in ("a", "b", "c")] == [None, 3, 3]
