"""Typed messages over a byte stream: the wire framing driven by real reads and writes, with a
deadline on every read (a peer that goes quiet must never hang us).

The byte stream is a libp2p stream in the daemon, or anything with the same read/write/close
(tests/memnet.py runs servers and clients over trio memory streams in one process)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Protocol, TypeVar

import trio
from libp2p.network.stream.exceptions import StreamError

from wire import Message, MessageDecoder, encode_message
from wire.decoding import Expect, TensorCheck

M = TypeVar("M", bound=Message)

READ_CHUNK = 1 << 20
# Scheduler passes a gathering send (MessageStream.send) lets other ready tasks run, at most: the
# pushes of one merged forward take two or three.
GATHER_PASSES = 8


class PeerGone(Exception):
    """The peer closed, reset or stopped answering the stream."""


class Idle(PeerGone):
    """Nothing arrived within the deadline (the stream itself may still be fine)."""


class ByteStream(Protocol):
    """What MessageStream needs of a stream: a libp2p INetStream has it, and so does a test's
    in-memory stream. `read` returns b"" at the end of the stream; a broken stream raises
    libp2p's StreamError or trio's BrokenResourceError/ClosedResourceError."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class MessageStream:
    """One byte stream carrying wire frames in both directions.

    `remote_peer` is the peer id at the other end; left out, it is the stream's own
    `remote_peer` attribute where it has one (an in-memory stream of the tests), else the peer of
    the libp2p connection the stream runs on. `check_tensor`: the receiver's rule on the shape
    of every tensor it receives, checked before the tensor's data is copied or decompressed
    (wire.decode_message)."""

    def __init__(
        self,
        stream: ByteStream,
        max_frame_size: int,
        remote_peer: str | None = None,
        *,
        check_tensor: TensorCheck | None = None,
    ) -> None:
        self.stream = stream
        self.max_frame_size = max_frame_size
        self._remote_peer = remote_peer
        self._decoder = MessageDecoder(max_frame_size=max_frame_size, check_tensor=check_tensor)
        self._send_lock = trio.Lock()  # one write at a time: frames must not interleave
        self._outbox: list[_Frame] = []  # frames queued for the next write
        self._broken: PeerGone | None = None  # a write failed: the stream's framing is lost

    @property
    def remote_peer(self) -> str:
        if self._remote_peer is None:
            self._remote_peer = getattr(self.stream, "remote_peer", None) or _libp2p_peer(
                self.stream
            )
        return self._remote_peer

    async def send(self, message: Message, compression: str = "raw", gather: bool = False) -> None:
        """Send one message, its tensors encoded with `compression` (wire.COMPRESSIONS).

        Messages sent while a write is under way go together in the next write (group commit):
        the receiver reads them in one go. `gather`: before its write, the sender lets the tasks
        that are ready to run go first, until two passes of them queue nothing more here
        (GATHER_PASSES at most, so a steady trickle cannot hold the write back), and the
        messages they send on this stream meanwhile join it: a server that pushes the outputs
        of one merged forward to the next server makes one write, not one for the first session
        and another for the rest. Each call returns once its own message is written; a call
        cancelled before then takes its message back unless a write already carries it."""
        frame = self.queue(message, compression)
        try:
            async with self._send_lock:
                queued = passes = quiet = 0
                while gather and passes < GATHER_PASSES:
                    # Until two passes in a row queue nothing: a sender that runs after us in
                    # one pass queues its message after we looked (trio runs a batch in any order).
                    quiet = quiet + 1 if len(self._outbox) == queued else 0
                    if quiet == 2:
                        break
                    queued, passes = len(self._outbox), passes + 1
                    await trio.lowlevel.checkpoint()
                if not frame.sent:
                    await self._write_outbox()
        except BaseException:
            if frame in self._outbox:
                self._outbox.remove(frame)
            raise

    def queue(self, message: Message, compression: str = "raw") -> _Frame:
        """Encode `message` now and send it ahead of the next `send`'s, in the same write: a
        request that another follows at once (an OpenSession and its first step) costs the
        peer one read, not two. Nothing is written until that send."""
        frame = _Frame(encode_message(message, compression, max_frame_size=self.max_frame_size))
        self._outbox.append(frame)
        return frame

    async def _write_outbox(self) -> None:
        if self._broken is not None:
            raise PeerGone(str(self._broken))
        frames, self._outbox = self._outbox, []
        data = frames[0].data if len(frames) == 1 else b"".join(f.data for f in frames)
        try:
            await self.stream.write(data)  # type: ignore[arg-type]  # any bytes-like works
        except (StreamError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._broken = PeerGone(f"cannot send to {self.remote_peer}: {e or type(e).__name__}")
            raise self._broken from e
        except BaseException:  # cancelled mid-write: part of a frame may be out
            self._broken = PeerGone(f"a write to {self.remote_peer} was cut off")
            raise
        for f in frames:
            f.sent = True

    async def receive(self, timeout: float, expect: Expect = None) -> Message:
        """The next message; PeerGone if the stream ends or nothing arrives within `timeout`;
        ProtocolError if the peer sent bytes that are not a valid message, or (`expect` given) a
        message of another type: then its frame is refused by its length alone when too large
        for every type expected (an info request never needs more than a few KiB), and its body
        is not read."""
        self._decoder.expect_next(expect)
        with trio.move_on_after(timeout):
            while True:
                message = self._decoder.next_message()
                if message is not None:
                    return message
                try:
                    data = await self.stream.read(READ_CHUNK)
                except (StreamError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    raise PeerGone(
                        f"{self.remote_peer} closed the stream ({type(e).__name__})"
                    ) from e
                if not data:
                    raise PeerGone(f"{self.remote_peer} closed the stream")
                self._decoder.receive_data(data)
        raise Idle(f"{self.remote_peer} sent nothing for {timeout:.0f} s")

    async def receive_as(self, kind: type[M], timeout: float) -> M:
        message = await self.receive(timeout, expect=kind)
        assert isinstance(message, kind)  # the decoder refused any other type
        return message

    async def close(self) -> None:
        # Closing a dead stream can fail in many ways; there is nothing left to do then.
        with trio.move_on_after(1), contextlib.suppress(Exception):
            await self.stream.close()


@dataclasses.dataclass(eq=False)
class _Frame:
    data: bytes | bytearray | memoryview
    sent: bool = False


def _libp2p_peer(stream: object) -> str:
    return str(stream.muxed_conn.peer_id.to_string())  # type: ignore[attr-defined]
