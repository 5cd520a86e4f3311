"""peerd.node.yamux_writes: frames queued while a write is under way go out in the next write, in
order; a writer cancelled before a write takes its frame takes it back; a failed write fails
every frame it carried. First on a stand-in connection whose writes the test holds open, then on
two real py-libp2p nodes (Noise and yamux over TCP), where many streams writing at once still
deliver every byte to the right stream."""

from __future__ import annotations

from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.io.exceptions import IOException
from libp2p.stream_muxer.yamux.yamux import Yamux
from trio.testing import wait_all_tasks_blocked

from peerd.node import yamux_writes
from peerd.node.p2p import open_node

PROTOCOL = "/peerd-test/echo/1.0.0"


class _Secured:
    """A secured connection whose writes each wait until the test lets them through."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.waiting = 0
        self.fail: Exception | None = None
        self._let, self._gate = trio.open_memory_channel[None](100)

    async def write(self, data: bytes) -> None:
        self.waiting += 1
        await self._gate.receive()
        self.waiting -= 1
        if self.fail is not None:
            raise self.fail
        self.writes.append(bytes(data))

    async def let_one_through(self) -> None:
        """Once every task is blocked, with one write under way: finish that write."""
        await wait_all_tasks_blocked()
        assert self.waiting == 1
        self._let.send_nowait(None)
        await wait_all_tasks_blocked()


class _Conn:
    """What write_frame uses of a Yamux: its write lock and secured connection."""

    def __init__(self) -> None:
        self._write_lock = trio.Lock()
        self.secured_conn = _Secured()


async def _write(conn: _Conn, data: bytes, errors: list[BaseException]) -> None:
    try:
        await yamux_writes.write_frame(conn, data)  # type: ignore[arg-type]
    except Exception as e:
        errors.append(e)


def test_installed_for_every_connection() -> None:
    import peerd.node.host  # noqa: F401  (installs it)

    assert Yamux._write_frame is yamux_writes.write_frame


async def test_frames_queued_during_a_write_go_out_together_in_order() -> None:
    conn, errors = _Conn(), []
    with trio.fail_after(10):  # a write the test forgot to let through fails it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write, conn, b"first", errors)
            await wait_all_tasks_blocked()  # the first frame's write is under way
            for frame in (b"second", b"third", b"fourth"):
                nursery.start_soon(_write, conn, frame, errors)
                await wait_all_tasks_blocked()  # queued in this order
            await conn.secured_conn.let_one_through()
            await conn.secured_conn.let_one_through()
    assert conn.secured_conn.writes == [b"first", b"secondthirdfourth"]
    assert errors == []
    box = yamux_writes.outbox(conn)  # type: ignore[arg-type]
    assert (box.writes, box.frames_written, box.frames) == (2, 4, [])


async def test_a_write_carries_frames_up_to_group_bytes_and_a_larger_first_frame_alone() -> None:
    conn, errors = _Conn(), []
    big = yamux_writes.GROUP_BYTES * 3 // 4
    queued = (b"a" * big, b"b" * big, b"c" * 10)
    with trio.fail_after(10):  # a write the test forgot to let through fails it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write, conn, b"first", errors)
            await wait_all_tasks_blocked()
            for frame in queued:
                nursery.start_soon(_write, conn, frame, errors)
                await wait_all_tasks_blocked()
            for _ in range(3):
                await conn.secured_conn.let_one_through()
    assert conn.secured_conn.writes == [b"first", queued[0], queued[1] + queued[2]]
    assert errors == []


async def test_a_cancelled_writer_takes_its_queued_frame_back() -> None:
    conn, errors = _Conn(), []
    scope = trio.CancelScope()

    async def cancelled_writer() -> None:
        with scope:
            await yamux_writes.write_frame(conn, b"dropped")  # type: ignore[arg-type]

    with trio.fail_after(10):  # a write the test forgot to let through fails it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write, conn, b"first", errors)
            await wait_all_tasks_blocked()
            nursery.start_soon(cancelled_writer)
            await wait_all_tasks_blocked()
            nursery.start_soon(_write, conn, b"kept", errors)
            await wait_all_tasks_blocked()
            scope.cancel()  # while its frame waits behind the first write
            await wait_all_tasks_blocked()
            await conn.secured_conn.let_one_through()
            await conn.secured_conn.let_one_through()
    assert scope.cancelled_caught
    assert conn.secured_conn.writes == [b"first", b"kept"]
    assert errors == []


async def test_a_failed_write_fails_every_frame_it_carried() -> None:
    conn, errors = _Conn(), []
    with trio.fail_after(10):  # a write the test forgot to let through fails it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write, conn, b"first", errors)
            await wait_all_tasks_blocked()
            for frame in (b"second", b"third"):
                nursery.start_soon(_write, conn, frame, errors)
                await wait_all_tasks_blocked()
            await conn.secured_conn.let_one_through()
            conn.secured_conn.fail = IOException("connection reset")
            await conn.secured_conn.let_one_through()
    assert conn.secured_conn.writes == [b"first"]
    assert len(errors) == 2 and all(type(e) is IOException for e in errors)
    assert errors[0] is not errors[1]  # each writer raises an exception of its own
    assert yamux_writes.outbox(conn).frames == []  # type: ignore[arg-type]


async def test_many_streams_writing_at_once_each_get_their_own_bytes() -> None:
    streams = 6

    async def echo(stream: Any) -> None:
        while True:
            data = await stream.read(1 << 20)
            if not data:
                return
            await stream.write(data)

    async with (
        open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as a,
        open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as b,
    ):
        b.host.set_stream_handler(PROTOCOL, echo)
        a.remember(b.peer_id, b.maddrs())
        opened = [await a.open_stream(b.peer_id, PROTOCOL) for _ in range(streams)]
        got: dict[int, bytes] = {}

        async def talk(i: int) -> None:
            sent = b""
            for k in range(20):
                message = bytes([i]) * (100 + 37 * k)
                sent += message
                await opened[i].write(message)
            received = b""
            while len(received) < len(sent):
                received += await opened[i].read(1 << 20)
            got[i] = received
            assert received == sent

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(talk, i)
        assert sorted(got) == list(range(streams))
        for stream in opened:
            await stream.close()
