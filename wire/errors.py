"""The one exception family for malformed wire input: `ProtocolError` and its subclasses.

Every decoder in `wire/` turns bad input into one of these and nothing else, so a caller that
reads from a peer needs exactly one `except ProtocolError` to drop the peer and say why. The
messages are written for the person reading a log: what was wrong and, where there is one, what to
do about it.
"""

from __future__ import annotations

import sys
import traceback


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


class NonFiniteTensor(ValueError):
    """A message being built holds nan or inf in a floating tensor.

    Not a ProtocolError: it is raised by our own side, never by a peer's bytes (a decoder turns
    the same finding in a received message into MalformedTensor). A server that gets it while
    building a reply answers an error instead of the values (peerd.server.boundary)."""


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


def detached(error: ProtocolError) -> ProtocolError:
    """A copy of `error` (same class, text and attributes) with no traceback, cause or context.

    A decoder that remembers its error to raise it again keeps the copy: the original's traceback
    holds the frames that were decoding, and their locals (a half-built list of millions of
    objects, a frame buffer), which would otherwise live as long as the decoder, in a reference
    cycle through it."""
    copy = type(error).__new__(type(error))
    copy.args = error.args
    copy.__dict__.update(error.__dict__)
    return copy


def detach_current() -> ProtocolError:
    """`detached` of the ProtocolError being handled, which goes on being raised, after the
    frames it came through have let go of their locals (what they were decoding): otherwise
    the exception, its traceback and those frames keep each other alive in a reference cycle
    until the garbage collector next runs, gigabytes after a few hostile frames. Call it in an
    `except ProtocolError:` clause that binds no name (a name would close another cycle)."""
    error = sys.exception()
    assert isinstance(error, ProtocolError)
    traceback.clear_frames(error.__traceback__)
    return detached(error)
