"""The one exception family for malformed wire input: `ProtocolError` and its subclasses.

Every decoder in `wire/` turns bad input into one of these and nothing else, so a caller that
reads from a peer needs exactly one `except ProtocolError` to drop the peer and say why. The
messages are written for the person reading a log: what was wrong and, where there is one, what to
do about it.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Bytes or values that break the peerd wire protocol (docs/wire.md)."""


class FrameTooLarge(ProtocolError):
    """A frame's length prefix (or a frame being encoded) is over the configured maximum."""

    def __init__(self, size: int, max_frame_size: int, *, sending: bool = False) -> None:
        self.size = size
        self.max_frame_size = max_frame_size
        if sending:
            text = (
                f"message is {size} bytes, over the {max_frame_size}-byte frame limit: "
                "send the tensor in smaller steps or with a smaller codec (float16, int8-blockwise)"
            )
        else:
            text = (
                f"peer announced a {size}-byte frame, over the {max_frame_size}-byte limit: "
                "refused before reading it (the peer is misbehaving, or both sides need a larger "
                "max_frame_size)"
            )
        super().__init__(text)


class MalformedFrame(ProtocolError):
    """The framing or the msgpack encoding of a frame body is broken."""


class MalformedMessage(ProtocolError):
    """A well-formed frame whose envelope or message fields break the message schema."""


class MalformedTensor(MalformedMessage):
    """An encoded tensor map that is inconsistent (dtype, shape, codec, byte counts)."""


class UnknownMessageType(MalformedMessage):
    """A message `type` this peerd does not know."""


class UnexpectedMessage(MalformedMessage):
    """A valid message of a type the receiver did not expect at this point."""


class VersionMismatch(ProtocolError):
    """The peer speaks a wire protocol version this peerd does not."""

    def __init__(self, remote: int, local: int, oldest_supported: int) -> None:
        self.remote = remote
        self.local = local
        self.oldest_supported = oldest_supported
        if remote > local:
            advice = "upgrade this peerd to talk to it"
        else:
            advice = "the peer must upgrade its peerd"
        supported = (
            f"version {local}"
            if oldest_supported == local
            else f"versions {oldest_supported}-{local}"
        )
        super().__init__(
            f"peer speaks peerd wire protocol version {remote}, this peerd speaks {supported}: "
            f"{advice}"
        )
