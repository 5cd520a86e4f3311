"""The byte pipe to the daemon's socket, once per client kind: AsyncTransport on anyio (trio or
asyncio) and Transport on a blocking socket. Both time out every wait after `timeout` seconds
(TimeoutError) and read b"" once the daemon hung up; they are the only difference between
AsyncClient and the SyncClient generated from it (peerd/sdk/unasync.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from contextlib import AbstractContextManager
from pathlib import Path

import anyio
import anyio.abc

from peerd.sdk.errors import DaemonNotRunning

READ_CHUNK = 1 << 16


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio
        return False
    return True


class _AsyncioUnixStream:
    """The daemon's socket through asyncio's own streams. anyio's UNIX socket stream on asyncio
    waits on the raw socket with a reader callback that a cancelled wait leaves armed for a
    moment: data arriving then makes the event loop log an InvalidStateError (a gateway whose
    clients hang up mid-request logged it; agronholm/anyio#1267). asyncio's streams go through a
    transport and take cancellation cleanly. Errors are anyio's, as from anyio's stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, data: bytes) -> None:
        try:
            self.writer.write(data)
            await self.writer.drain()
        except OSError as e:
            raise anyio.BrokenResourceError(str(e)) from e

    async def receive(self, max_bytes: int) -> bytes:
        if data := await self.reader.read(max_bytes):
            return data
        raise anyio.EndOfStream

    async def aclose(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


class AsyncTransport:
    def __init__(self, stream: anyio.abc.ByteStream | _AsyncioUnixStream, timeout: float) -> None:
        self._stream = stream
        self.timeout = timeout

    @classmethod
    async def connect(cls, path: Path, timeout: float) -> AsyncTransport:
        """Raises DaemonNotRunning when nothing answers on `path` within `timeout`."""
        stream: anyio.abc.ByteStream | _AsyncioUnixStream
        try:
            with anyio.fail_after(timeout):
                if _on_asyncio():
                    stream = _AsyncioUnixStream(*await asyncio.open_unix_connection(str(path)))
                else:
                    stream = await anyio.connect_unix(str(path))
        except OSError as e:  # TimeoutError included: a daemon that never accepts is not running
            raise DaemonNotRunning(path, e.strerror or str(e) or type(e).__name__) from None
        return cls(stream, timeout)

    async def send(self, data: bytes) -> None:
        with anyio.fail_after(self.timeout):
            await self._stream.send(data)

    async def receive(self) -> bytes:
        """The next bytes the daemon sent (b"" once it hung up)."""
        try:
            with anyio.fail_after(self.timeout):
                return await self._stream.receive(READ_CHUNK)
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return b""

    def shielded(self) -> anyio.CancelScope:
        """A scope that the caller's cancellation does not interrupt (for the Cancel exchange
        that leaves the connection usable after a stream is abandoned)."""
        return anyio.CancelScope(shield=True)

    async def aclose(self) -> None:
        await self._stream.aclose()


class Transport:
    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self.timeout = timeout

    @classmethod
    def connect(cls, path: Path, timeout: float) -> Transport:
        """Raises DaemonNotRunning when nothing answers on `path` within `timeout`."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError as e:
            sock.close()
            raise DaemonNotRunning(path, e.strerror or str(e) or type(e).__name__) from None
        return cls(sock, timeout)

    def send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def receive(self) -> bytes:
        """The next bytes the daemon sent (b"" once it hung up)."""
        try:
            return self._sock.recv(READ_CHUNK)
        except ConnectionResetError:
            return b""

    def shielded(self) -> AbstractContextManager[None]:
        """Nothing to shield from: a blocking call is only interrupted by an exception."""
        return contextlib.nullcontext()

    def close(self) -> None:
        self._sock.close()
