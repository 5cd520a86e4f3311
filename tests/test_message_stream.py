"""peerd.node.streams.MessageStream's sends: messages sent while a write is under way go out
together in the next write, each sender returns once its own message is written, one cancelled
before that takes its message back, and a failed write fails every message it carried."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

import wire
from peerd.node.streams import GATHER_PASSES, MessageStream, PeerGone, _Frame
from wire import encode_message

MAX_FRAME = 1 << 20


class _SlowStream:
    """A byte stream whose writes each wait until the test lets them through (or fail)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.go = trio.Event()
        self.fail = False

    async def write(self, data: bytes) -> None:
        await self.go.wait()
        if self.fail:
            raise trio.BrokenResourceError("the peer reset the connection")
        self.writes.append(bytes(data))

    async def read(self, n: int | None = None) -> bytes:
        raise AssertionError("not read in these tests")

    async def close(self) -> None:
        pass


def _step(i: int) -> wire.Step:
    return wire.Step(session_id=f"s{i}", step_id=i, hidden_states=torch.full((1, 1, 4), float(i)))


def _decoded(writes: list[bytes]) -> list[int]:
    decoder = wire.MessageDecoder(max_frame_size=MAX_FRAME)
    decoder.receive_data(b"".join(writes))
    steps = []
    while (message := decoder.next_message()) is not None:
        assert isinstance(message, wire.Step)
        steps.append(message.step_id)
    return steps


async def test_sends_during_a_write_go_together_in_the_next_and_each_returns_when_written() -> None:
    raw = _SlowStream()
    stream = MessageStream(raw, MAX_FRAME, "peer")
    returned: list[int] = []

    async def send(i: int) -> None:
        await stream.send(_step(i))
        returned.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(send, i)
        await trio.testing.wait_all_tasks_blocked()
        assert returned == []  # the first write waits, the other three wait for it
        raw.go.set()
    # The first sender's write took along what the others queued before it ran (trio lets
    # them queue while the first waits for the lock's checkpoint): one write, not four.
    assert len(raw.writes) == 1
    assert sorted(_decoded(raw.writes)) == [0, 1, 2, 3] and sorted(returned) == [0, 1, 2, 3]
    # A send while nothing is queued writes its own message alone, at once.
    await stream.send(_step(4))
    assert _decoded(raw.writes[1:]) == [4]


async def test_a_send_cancelled_before_its_write_takes_its_message_back() -> None:
    raw = _SlowStream()
    stream = MessageStream(raw, MAX_FRAME, "peer")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send, _step(0))
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            scope.cancel()
            await stream.send(_step(1))
        nursery.start_soon(stream.send, _step(2))
        await trio.testing.wait_all_tasks_blocked()
        raw.go.set()
    assert _decoded(raw.writes) == [0, 2]


async def test_a_failed_write_fails_every_message_it_carried_and_later_ones() -> None:
    raw = _SlowStream()
    stream = MessageStream(raw, MAX_FRAME, "peer")
    failed: list[int] = []

    async def send(i: int) -> None:
        try:
            await stream.send(_step(i))
        except PeerGone:
            failed.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(send, i)
        await trio.testing.wait_all_tasks_blocked()
        raw.fail = True
        raw.go.set()
    assert sorted(failed) == [0, 1, 2] and raw.writes == []
    with pytest.raises(PeerGone, match="cannot send to peer"):
        await stream.send(_step(3))


class _CountingStream:
    """A byte stream that takes every write at once and keeps them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.writes.append(bytes(data))

    async def read(self, n: int | None = None) -> bytes:
        raise AssertionError("not read in these tests")

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("gather", [True, False])
async def test_gathering_sends_of_tasks_woken_together_make_one_write(gather: bool) -> None:
    raw = _CountingStream()
    stream = MessageStream(raw, MAX_FRAME, "peer")
    go = trio.Event()

    async def send(i: int) -> None:
        await go.wait()  # woken together, as the sessions of one merged forward are
        for _ in range(i % 3):  # then on their way to the send, some pass more checkpoints
            await trio.lowlevel.checkpoint()
        await stream.send(_step(i), gather=gather)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(send, i)
        await trio.testing.wait_all_tasks_blocked()
        go.set()
    assert sorted(_decoded(raw.writes)) == list(range(8))
    if gather:
        assert len(raw.writes) == 1
    else:  # the first write goes before the stragglers queue
        assert len(raw.writes) > 1
    # A lone gathering send is written at once, alone.
    await stream.send(_step(8), gather=True)
    assert _decoded(raw.writes[-1:]) == [8]


async def test_a_trickle_of_senders_holds_a_gathering_write_back_only_so_long() -> None:
    raw = _CountingStream()
    stream = MessageStream(raw, MAX_FRAME, "peer")
    written_after: list[int] = []

    async def trickle() -> None:  # one more message every scheduler pass
        for i in range(1, 3 * GATHER_PASSES):
            stream._outbox.append(_Frame(encode_message(_step(i), "raw", max_frame_size=MAX_FRAME)))
            if raw.writes and not written_after:
                written_after.append(i)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send, _step(0), "raw", True)
        nursery.start_soon(trickle)
    # Written after GATHER_PASSES passes (and the lock's and the write's own), not at the end.
    assert written_after and written_after[0] <= GATHER_PASSES + 4


async def test_a_queued_message_goes_ahead_of_the_next_send_in_its_write() -> None:
    """An OpenSession and its first step: one write, in that order; nothing before the send."""
    raw = _CountingStream()
    stream = MessageStream(raw, MAX_FRAME, "peer")
    stream.queue(_step(0))
    assert raw.writes == []
    await stream.send(_step(1), "raw")
    assert len(raw.writes) == 1 and _decoded(raw.writes) == [0, 1]
