"""The fault boundary around each stream a server handles: whatever goes wrong in one stream ends
that stream, never the daemon.

A peer that breaks the protocol gets Error(bad_request); a peer that went away gets nothing; an
exception of any other kind is a bug of ours: it is logged with its traceback and the peer gets
Error(internal), so it knows not to blame itself (nor is it banned: it did nothing wrong). The
stream is closed in every case, and the server goes on serving the others.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import wire
from peerd.node.streams import MessageStream, PeerGone

log = logging.getLogger(__name__)

# Time a client gets to send its first message after opening a stream.
OPEN_TIMEOUT_S = 10.0
# A stream (session, push, training) that sends nothing for this long is closed: a client that
# went away without closing must not hold cache forever. Clients step far more often than this.
SESSION_IDLE_TIMEOUT_S = 300.0


class CountsErrors(Protocol):
    """A server that counts the errors it answers, by code (BlockServer)."""

    async def refuse(self, messages: MessageStream, code: wire.ErrorCode, text: str) -> None: ...


async def refuse(messages: MessageStream, code: wire.ErrorCode, text: str) -> None:
    """Answer an Error; a peer that is gone already cannot hear it, and that is fine."""
    log.info("refused a request from %s: %s", messages.remote_peer, text)
    with contextlib.suppress(PeerGone):
        await messages.send(wire.Error(code=code, message=text))


@contextlib.asynccontextmanager
async def stream_boundary(
    server: CountsErrors,
    messages: MessageStream,
    protocol: str,
    *,
    answer_protocol_errors: bool = True,
) -> AsyncIterator[None]:
    """Run one stream's handler inside: see the module docstring. `answer_protocol_errors`
    False: a protocol error ends the stream without an answer (push streams are never
    answered)."""
    try:
        yield
    except wire.NonFiniteTensor as e:
        # Our own blocks produced nan or inf (finite inputs are checked on arrival): a faulty
        # device or weights, or an input that overflowed the span's dtype. The peer gets an
        # error, never the values, and goes to another server.
        log.warning(
            "%s request from %s gave non-finite output: %s", protocol, messages.remote_peer, e
        )
        await server.refuse(
            messages,
            wire.ErrorCode.INTERNAL,
            "this server's blocks produced nan or inf for this request (its device or weights may "
            "be faulty, or the input overflowed its dtype): try another server",
        )
    except wire.ProtocolError as e:
        if answer_protocol_errors:
            await server.refuse(messages, wire.ErrorCode.BAD_REQUEST, str(e))
        else:
            log.info("%s stream from %s broke the protocol: %s", protocol, messages.remote_peer, e)
    except PeerGone as e:
        log.debug("%s stream from %s ended: %s", protocol, messages.remote_peer, e)
    except Exception:
        log.exception("bug while handling a %s stream from %s", protocol, messages.remote_peer)
        await server.refuse(
            messages,
            wire.ErrorCode.INTERNAL,
            f"this server failed handling the {protocol} request (a bug on its side, logged there)",
        )
    finally:
        await messages.close()
