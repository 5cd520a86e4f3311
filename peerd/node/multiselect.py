"""Protocol negotiation in one round trip instead of two.

py-libp2p's multistream-select client writes its header (`/multistream/1.0.0`), waits for the
listener's, then proposes a protocol and waits again: two round trips for every stream a daemon
opens, and two for each of a dial's two negotiations (security, then muxer). Measured between
two namespaces 50 ms apart (notes/libp2p.md): a dial took 6.4 round trips, a stream 2.15 before
its first byte, so an `info` call to a new peer cost 9.7 round trips and one to a connected peer
3.2.

`PipelinedMultiselectClient` writes the header and its first proposal together and then reads the
listener's header and answer, as go-libp2p and rust-libp2p dialers do. A listener reads the two
messages one after the other whether they came in one packet or two, so nothing changes for it.
When the first proposal is refused (`na`) the rest are proposed one at a time, as before.

`OptimisticStream` goes one step further for a stream whose one protocol we expect the peer to
speak (a request to a server we found in its records): the header and the proposal go out with
the stream's first message, and the listener's answer is read before the first reply, so a new
stream costs no round trip of its own (rust-libp2p's `V1Lazy`). The listener again reads the same
bytes. A peer that does not speak the protocol answers `na` and the first read raises
ProtocolRefused; what we sent after the proposal is lost with the stream, so only a request that
can fail that way may use it (never `Node.tell`, which counts who accepted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio
from libp2p.abc import IHost, IMultiselectCommunicator, INetStream
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import IOException
from libp2p.network.stream.exceptions import StreamError
from libp2p.protocol_muxer.exceptions import (
    MultiselectClientError,
    MultiselectCommunicatorError,
    ProtocolNotSupportedError,
)
from libp2p.protocol_muxer.multiselect_client import (
    DEFAULT_NEGOTIATE_TIMEOUT,
    MULTISELECT_PROTOCOL_ID,
    PROTOCOL_NOT_FOUND_MSG,
    MultiselectClient,
    is_valid_handshake,
)
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.utils import encode_delim


class PipelinedMultiselectClient(MultiselectClient):
    """A multistream-select dialer that sends its header and first proposal in one write."""

    async def select_one_of(
        self,
        protocols: Sequence[TProtocol],
        communicator: IMultiselectCommunicator,
        negotiate_timeout: int = DEFAULT_NEGOTIATE_TIMEOUT,
    ) -> TProtocol:
        writer = getattr(communicator, "read_writer", None)
        if not protocols or writer is None:
            return await super().select_one_of(protocols, communicator, negotiate_timeout)
        first, *rest = protocols
        with trio.move_on_after(negotiate_timeout):
            try:
                await writer.write(
                    encode_delim(MULTISELECT_PROTOCOL_ID.encode()) + encode_delim(first.encode())
                )
                header = await communicator.read()
                answer = await communicator.read()
            except (IOException, MultiselectCommunicatorError, ValueError) as e:
                raise MultiselectClientError(f"negotiating {first} failed: {e}") from e
            if not is_valid_handshake(header):
                raise MultiselectClientError(
                    f"multiselect protocol ID mismatch: expected {MULTISELECT_PROTOCOL_ID}, "
                    f"got {header!r}"
                )
            if answer == first:
                return first
            if answer != PROTOCOL_NOT_FOUND_MSG:
                raise MultiselectClientError(
                    f"unrecognized response {answer!r} to {first}, expected it or "
                    f"{PROTOCOL_NOT_FOUND_MSG!r}"
                )
            for protocol in rest:
                try:
                    return await self.try_select(communicator, protocol)
                except ProtocolNotSupportedError:
                    continue
            raise MultiselectClientError(f"protocols not supported: {list(protocols)}")
        raise MultiselectClientError(
            f"response timed out after {negotiate_timeout}s, protocols tried: {list(protocols)}"
        )


def pipeline_negotiation(host: IHost) -> None:
    """Give `host` the pipelined client for its streams and for its dials' security and muxer
    negotiation (py-libp2p's upgrader holds one selector for each)."""
    client = PipelinedMultiselectClient()
    host.multiselect_client = client  # type: ignore[attr-defined]
    upgrader: Any = getattr(host.get_network(), "upgrader", None)
    for name in ("security_multistream", "muxer_multistream"):
        selector = getattr(getattr(upgrader, name, None), "_selector", None)
        if selector is not None:
            selector.multiselect_client = client


class ProtocolRefused(StreamError):
    """The peer answered an optimistic proposal with anything but the protocol (a stream error:
    a reader of the stream sees a peer that ended it)."""


class OptimisticStream:
    """A libp2p stream whose protocol (`protocol`) is proposed with its first write and
    confirmed by its first read. Everything else is the stream's own (`muxed_conn`,
    `reset`, ...)."""

    def __init__(self, stream: INetStream, protocol: TProtocol) -> None:
        self.stream = stream
        self.protocol = protocol
        stream.set_protocol(protocol)
        self._preamble: bytes | None = encode_delim(MULTISELECT_PROTOCOL_ID.encode()) + (
            encode_delim(protocol.encode())
        )
        self._write_lock = trio.Lock()
        self._read_lock = trio.Lock()
        self._confirmed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    async def write(self, data: bytes) -> None:
        if self._preamble is not None:
            async with self._write_lock:
                preamble, self._preamble = self._preamble, None
                if preamble is not None:  # (not sent by a read meanwhile)
                    await self.stream.write(preamble + bytes(data))
                    return
        await self.stream.write(data)

    async def read(self, n: int | None = None) -> bytes:
        if not self._confirmed:
            async with self._read_lock:
                if not self._confirmed:
                    await self._confirm()
        return await self.stream.read(n)

    async def _confirm(self) -> None:
        """Read the listener's header and its answer to our proposal (sending the proposal
        alone if nothing was written yet)."""
        if self._preamble is not None:
            await self.write(b"")
        communicator = MultiselectCommunicator(self.stream)
        try:
            header = await communicator.read()
            answer = await communicator.read()
        except (IOException, MultiselectCommunicatorError, ValueError) as e:
            raise ProtocolRefused(f"negotiating {self.protocol} failed: {e}") from e
        if not is_valid_handshake(header) or answer != self.protocol:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.stream.reset()
            raise ProtocolRefused(
                f"the peer does not speak {self.protocol} (it answered {answer!r})"
            )
        self._confirmed = True

    async def close(self) -> None:
        await self.stream.close()

    async def reset(self) -> None:
        await self.stream.reset()
