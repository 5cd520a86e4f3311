"""Yamux frames written to the connection in groups: frames queued while another write is under
way go out together in the next one (group commit).

py-libp2p 0.8.1's `Yamux._write_frame` takes the connection's write lock for each frame, so
each frame is one Noise encryption, one socket write and, at the other end, one socket read and
one decryption. The frames of one connection often come at once: the four sessions of a client's
micro-batch send their steps to the same first server, and a server answers the sessions of one
merged forward on their own streams of the same client connection. `install()` replaces
`_write_frame` with one that queues each frame and lets the holder of the write lock send the
frames queued by then as one write (up to GROUP_BYTES; order kept: frames leave in the order they
were queued). A frame whose writer is cancelled before a write takes it is taken back, as before
it was never written; one already carried by a write is sent whatever becomes of its writer. A
failed write fails every frame it carried.

It also skips the per-frame debug line py-libp2p formats (an f-string built for every frame,
logged or not).
"""

from __future__ import annotations

import copy
import dataclasses

import trio
from libp2p.io.exceptions import IOException
from libp2p.stream_muxer.yamux.yamux import Yamux

# A write carries queued frames of at most this many bytes in all (a first frame larger than that
# goes alone): a prompt's frames are already large, and joining them would only copy them.
GROUP_BYTES = 256 << 10


@dataclasses.dataclass(eq=False)
class _Frame:
    data: bytes
    sent: bool = False
    error: BaseException | None = None


class _Outbox:
    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.writes = 0  # how many writes carried frames (the grouping as tests and probes see it)
        self.frames_written = 0


def outbox(conn: Yamux) -> _Outbox:
    """The frames waiting to be written on `conn` (made on first use)."""
    box: _Outbox | None = conn.__dict__.get("_peerd_outbox")
    if box is None:
        box = conn.__dict__["_peerd_outbox"] = _Outbox()
    return box


async def write_frame(self: Yamux, data: bytes) -> None:
    """Queue `data` (one yamux frame) and return once a write carried it."""
    box = outbox(self)
    frame = _Frame(data)
    box.frames.append(frame)
    try:
        async with self._write_lock:
            while not frame.sent and frame.error is None:  # frames ahead of ours go first
                await _write_queued(self, box)
    except BaseException:
        if frame in box.frames:  # cancelled before any write took it
            box.frames.remove(frame)
        raise
    if frame.error is not None:  # another writer's write carried our frame and failed
        raise _own_copy(frame.error)
    await trio.lowlevel.checkpoint()


async def _write_queued(conn: Yamux, box: _Outbox) -> None:
    size = 0
    taken = 0
    for queued in box.frames:
        if taken and size + len(queued.data) > GROUP_BYTES:
            break
        size += len(queued.data)
        taken += 1
    frames, box.frames = box.frames[:taken], box.frames[taken:]
    data = frames[0].data if taken == 1 else b"".join(f.data for f in frames)
    try:
        await conn.secured_conn.write(data)
    except BaseException as e:
        # The other frames' writers get the failure; a write cut off by the holder's own
        # cancellation is theirs as a broken connection (part of a frame may be out).
        shared = (
            e if isinstance(e, Exception) else IOException("a write of this connection was cut off")
        )
        for f in frames:
            f.error = shared
        raise
    box.writes += 1
    box.frames_written += taken
    for f in frames:
        f.sent = True


def _own_copy(error: BaseException) -> BaseException:
    """`error` as an exception of the same type for another task to raise (one instance raised
    in several tasks would collect all their tracebacks)."""
    try:
        return copy.copy(error)
    except Exception:
        return IOException(str(error))


def install() -> None:
    """Use `write_frame` for every yamux connection of this process."""
    Yamux._write_frame = write_frame  # type: ignore[method-assign]
