"""Yamux receive credit released the go-yamux way: a stream sends WINDOW_UPDATE once half its
receive window has been read, not after most reads.

py-libp2p 0.8.1's `YamuxStream.read` calls `_auto_tune_and_send_window_update` after each chunk
it hands out. With `PY_YAMUX_RELEASE_ON_READ=0` it still credits any shortfall below the target
window at once ("partial slack"), so a stream that receives one small message at a time (a
decode step, its reply: ~2.5 KB) sends a WINDOW_UPDATE frame after every other message, and
`read` returns the message only once that frame is encrypted and written. Every hand-over of a
token paid for it, and the peer paid to read the frame. `install()` replaces the method with the
go-yamux rule: read bytes accumulate, and once they reach half the target window they are
credited in one update (with py-libp2p's own window growth for fast links, which runs when an
update is sent). A sender never waits on this: it holds at least half a window of credit, less
what is in flight.
"""

from __future__ import annotations

from libp2p.stream_muxer.yamux.yamux import YamuxStream


async def release_on_half_window(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """Credit `bytes_read` read bytes back to the sender once half the target window is due."""
    async with self.window_lock:
        self._pending_recv_release += bytes_read
        pending = self._pending_recv_release
        if pending < self._grow_threshold() or pending <= 0:
            return
        self._pending_recv_release = 0
        self.recv_window += pending
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        increment = pending + self._apply_autotune_epoch(buffered)
    await self.send_window_update(increment, skip_lock=True)


def install() -> None:
    """Use `release_on_half_window` for every yamux stream of this process."""
    YamuxStream._auto_tune_and_send_window_update = release_on_half_window  # type: ignore[method-assign]
