"""Typed messages over a libp2p stream: the wire framing driven by real reads and writes, with a
deadline on every read (a peer that goes quiet must never hang us)."""

from __future__ import annotations

import contextlib
from typing import TypeVar

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamError

from wire import Message, MessageDecoder, ProtocolError, encode_message

M = TypeVar("M", bound=Message)

READ_CHUNK = 1 << 20


class PeerGone(Exception):
    """The peer closed, reset or stopped answering the stream."""


class Idle(PeerGone):
    """Nothing arrived within the deadline (the stream itself may still be fine)."""


class MessageStream:
    """One libp2p stream carrying wire frames in both directions."""

    def __init__(self, stream: INetStream, max_frame_size: int) -> None:
        self.stream = stream
        self.max_frame_size = max_frame_size
        self._decoder = MessageDecoder(max_frame_size=max_frame_size)
        self._send_lock = trio.Lock()  # frames from two tasks must not interleave

    @property
    def remote_peer(self) -> str:
        return self.stream.muxed_conn.peer_id.to_string()

    async def send(self, message: Message, compression: str = "raw") -> None:
        """Send one message, its tensors encoded with `compression` (wire.COMPRESSIONS)."""
        data = encode_message(message, compression, max_frame_size=self.max_frame_size)
        try:
            async with self._send_lock:
                await self.stream.write(data)  # type: ignore[arg-type]  # any bytes-like works
        except (StreamError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise PeerGone(f"cannot send to {self.remote_peer}: {e or type(e).__name__}") from e

    async def receive(self, timeout: float) -> Message:
        """The next message; PeerGone if the stream ends or nothing arrives within `timeout`;
        ProtocolError if the peer sent bytes that are not a valid message."""
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
        message = await self.receive(timeout)
        if not isinstance(message, kind):
            raise ProtocolError(f"expected a {kind.__name__} message, got {type(message).__name__}")
        return message

    async def close(self) -> None:
        # Closing a dead stream can fail in many ways; there is nothing left to do then.
        with trio.move_on_after(1), contextlib.suppress(Exception):
            await self.stream.close()
