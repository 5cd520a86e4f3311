"""The block server: serves one span of a model to anyone over the info and inference protocols.

It never runs code from the network: only its own blocks' forward, on tensors whose sizes it has
checked against its limits before allocating anything for them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import trio
from libp2p.peer.id import ID

import wire
from blocks import MemoryCache, Span, SpanSession
from peerd import __version__
from peerd.node.p2p import PUSH_PROTOCOL, Node
from peerd.node.streams import ByteStream, Idle, MessageStream, PeerGone
from peerd.server.admission import Admission, Refused
from peerd.server.batching import StepBatcher
from peerd.server.compute import PRIORITY_TRAINING, ComputeQueue
from routing.records import ServerRecord, ServerState, record_to_info
from wire.peer_protocol import DEFAULT_SESSIONS_PER_PEER

log = logging.getLogger(__name__)

# A session that sends nothing for this long is closed and its cache freed: a client that went
# away without closing must not hold cache forever. Clients step far more often than this.
SESSION_IDLE_TIMEOUT_S = 300.0
# Time a client gets to send its first message after opening a stream.
OPEN_TIMEOUT_S = 10.0
# A push that does not go through in this long is abandoned: the client relays instead.
PUSH_TIMEOUT_S = 5.0
# TESTS ONLY: a server started with PEERD_TEST_CORRUPT=F adds noise to a fraction F of its
# step outputs, so tests can check that clients catch a lying server (peerd.session.verify). Nothing
# else sets it; docs/operations.md says never to.
TEST_CORRUPT_ENV = "PEERD_TEST_CORRUPT"
# Pushed steps one session may have waiting here. A client sends a session's next step only once
# it has the last one's result, so more than a handful queued means a confused or hostile peer.
MAX_PUSHED_QUEUED = 8


class AdapterMissing(wire.ProtocolError):
    """A session asked for a LoRA adapter this server does not have (Error adapter_not_found)."""


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of this server; checked before any allocation."""

    max_frame_size: int = wire.DEFAULT_MAX_FRAME_SIZE
    max_batch_size: int = 8
    max_session_length: int = 8192
    max_sessions_per_peer: int = DEFAULT_SESSIONS_PER_PEER
    # Activations of a cache-less pass grow with batch x tokens; autograd keeps them all for the
    # backward. 8192 x 576 fp32 x ~20 saved tensors per block stays within a few GiB per span.
    max_training_tokens: int = 8192
    # Bytes of steps one peer may have queued or computing here at once: one peer's prefills
    # must not fill the compute queue for everyone (one step alone is always taken).
    max_inflight_bytes_per_peer: int = 256 << 20


@dataclass
class ServerCounters:
    sessions_opened: int = 0
    sessions_refused: int = 0
    steps: int = 0
    tokens_processed: int = 0
    training_passes: int = 0  # forward and backward requests run
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1


@dataclass
class _LiveSession:
    """A session open on this server, found by id when a previous server pushes a step."""

    request: wire.OpenSession
    session: SpanSession
    messages: MessageStream  # the client's session stream: every result goes there
    scope: trio.CancelScope
    lock: trio.Lock = field(default_factory=trio.Lock)  # one step at a time, from either side
    last_active: float = field(default_factory=trio.current_time)
    failure: Refused | None = None
    # Steps pushed by the previous server, in order; the session's own task runs them, so
    # pushed steps of different sessions run concurrently (and merge into one forward).
    pushed: tuple[trio.MemorySendChannel[wire.Step], trio.MemoryReceiveChannel[wire.Step]] = field(
        default_factory=lambda: trio.open_memory_channel[wire.Step](MAX_PUSHED_QUEUED)
    )


class BlockServer:
    """Serves `span` (blocks span.start..span.end-1 of `model`) with KV caches from `cache`."""

    def __init__(
        self,
        *,
        model: str,
        start: int,
        end: int,
        compute: ComputeQueue,
        peer_id: str,
        addrs: Callable[[], list[str]],
        limits: ServerLimits | None = None,
        record_ttl: float = math.inf,
        node: Node | None = None,
        adapters: tuple[str, ...] = (),
        batching: bool = True,
        swarm_name: str = "",
    ) -> None:
        self.model = model
        self.swarm_name = swarm_name
        self.adapters = adapters  # LoRA adapters the span is loaded with (named in the record)
        self._start, self._end = start, end
        self.compute = compute
        # Concurrent steps of different sessions share a forward (batching=False: one each).
        self.batcher = StepBatcher(compute, enabled=batching)
        self.peer_id = peer_id
        self.addrs = addrs
        self.limits = limits or ServerLimits()
        self.record_ttl = record_ttl
        self.state = ServerState.JOINING
        self.counters = ServerCounters()
        self.span: Span | None = None
        self.cache: MemoryCache | None = None
        self.throughput = 0.0
        self.hidden_size = 0
        self.admission = Admission(
            max_sessions_per_peer=self.limits.max_sessions_per_peer,
            max_inflight_bytes_per_peer=self.limits.max_inflight_bytes_per_peer,
        )
        self._open_sessions: set[trio.CancelScope] = set()
        self._subspans: dict[tuple[int, int], Span] = {}
        self.node = node
        self._live: dict[str, _LiveSession] = {}  # session id -> session, for pushed steps
        self._push_streams: dict[str, MessageStream] = {}  # next hop's peer id -> stream
        self._push_locks: dict[str, trio.Lock] = {}
        self._corrupt_fraction = float(os.environ.get(TEST_CORRUPT_ENV) or 0.0)
        if self._corrupt_fraction:
            log.warning("%s is set: this server returns WRONG results", TEST_CORRUPT_ENV)

    def go_online(self, span: Span, cache: MemoryCache, throughput: float) -> None:
        """Start taking sessions: the span is loaded and its speed known."""
        if (span.start, span.end) != (self._start, self._end):
            raise ValueError(
                f"loaded blocks {span.start}:{span.end}, announced {self.start}:{self.end}"
            )
        self.span, self.cache, self.throughput = span, cache, throughput
        self.hidden_size = int(span.config.hidden_size)
        self.state = ServerState.ONLINE

    @property
    def start(self) -> int:
        return self._start

    @property
    def end(self) -> int:
        return self._end

    def record(self) -> ServerRecord:
        now = time.time()
        return ServerRecord(
            peer_id=self.peer_id,
            model=self.model,
            start=self.start,
            end=self.end,
            throughput=self.throughput,
            free_cache_tokens=self._free_cache_tokens(),
            state=self.state,
            version=__version__,
            addrs=tuple(self.addrs()),
            # Behind NAT with a relay reservation: routes through us cost a relayed hop.
            relayed=self.node.relayed if self.node is not None else False,
            adapters=self.adapters,
            max_session_length=self.limits.max_session_length,
            max_sessions_per_peer=self.limits.max_sessions_per_peer,
            max_inflight_bytes_per_peer=self.limits.max_inflight_bytes_per_peer,
            queued_sessions=self.admission.queued,
            swarm=self.swarm_name,
            updated_at=now,
            expires_at=now + self.record_ttl,
        )

    def _free_cache_tokens(self) -> int:
        """Free cache less what the queued requests wait for: routing should not send a new
        session to a server whose free cache is already promised."""
        if self.cache is None:
            return 0
        return max(0, self.cache.free_tokens - self.admission.queued_tokens)

    @property
    def open_sessions(self) -> int:
        return len(self._open_sessions)

    # --- info -------------------------------------------------------------------------------

    async def handle_info(self, stream: ByteStream, remote_peer: str | None = None) -> None:
        messages = MessageStream(stream, self.limits.max_frame_size, remote_peer)
        try:
            await messages.receive_as(wire.InfoRequest, OPEN_TIMEOUT_S)
            await messages.send(wire.InfoResponse(record=record_to_info(self.record())))
        except wire.ProtocolError as e:
            await self._refuse(messages, "bad_request", str(e))
        except PeerGone:
            pass
        finally:
            await messages.close()

    # --- inference --------------------------------------------------------------------------

    async def handle_inference(self, stream: ByteStream, remote_peer: str | None = None) -> None:
        """One stream = one session: OpenSession, then Step* (each answered by a StepResult),
        then CloseSession or the stream's end. Any error ends the session with an Error reply
        and frees its cache; other sessions are untouched."""
        messages = MessageStream(stream, self.limits.max_frame_size, remote_peer)
        peer = messages.remote_peer
        try:
            request = await messages.receive_as(wire.OpenSession, OPEN_TIMEOUT_S)
            try:
                self._check_open(request)
            except AdapterMissing as e:
                self.counters.sessions_refused += 1
                await self._refuse(messages, wire.ErrorCode.ADAPTER_NOT_FOUND, str(e))
                return
            with self.admission.session_slot(peer):
                await self._open_and_serve(request, messages)
        except Refused as e:
            self.counters.sessions_refused += 1
            await self._refuse(messages, e.code, str(e))
        except wire.ProtocolError as e:
            await self._refuse(messages, "bad_request", str(e))
        except PeerGone as e:
            log.debug("session from %s ended: %s", peer, e)
        finally:
            await messages.close()

    async def _open_and_serve(self, request: wire.OpenSession, messages: MessageStream) -> None:
        assert self.cache is not None  # _check_open refuses sessions until we are online
        session = await self.admission.open_session(
            self.cache,
            request.batch_size,
            request.max_length,
            request.wait_timeout,
            request.left_padding or None,
        )
        self.counters.sessions_opened += 1
        live = _LiveSession(request, session, messages, trio.CancelScope())
        try:
            with session, live.scope:
                self._open_sessions.add(live.scope)
                self._live[request.session_id] = live
                await messages.send(
                    wire.SessionOpened(session_id=request.session_id, max_length=request.max_length)
                )
                error: Exception | None = None  # raised as itself, not in an exception group
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._serve_pushed, live)
                    try:
                        await self._serve_steps(live)
                    except Exception as e:
                        error = e
                    nursery.cancel_scope.cancel()
                if error is not None:
                    raise error
            if live.failure is not None:  # a pushed step broke the session
                raise live.failure
        finally:
            self._live.pop(request.session_id, None)
            self._open_sessions.discard(live.scope)
            self.admission.cache_freed()

    def _check_open(self, request: wire.OpenSession) -> None:
        if request.model != self.model:
            raise wire.ProtocolError(
                f"this server serves model {self.model!r}, not {request.model!r}"
            )
        if not (self.start <= request.start < request.end <= self.end):
            raise wire.ProtocolError(
                f"this server holds blocks {self.start}:{self.end} of {self.model}; it cannot run "
                f"blocks {request.start}:{request.end}"
            )
        if self.state is not ServerState.ONLINE:
            raise wire.ProtocolError(f"this server is {self.state.value} and takes no new sessions")
        adapter = request.active_adapter
        if adapter is not None and adapter not in self.adapters:
            offered = ", ".join(self.adapters) or "none"
            raise AdapterMissing(
                f"this server has no adapter {adapter!r} for blocks {self.start}:{self.end} (it "
                f"has: {offered}); route through servers whose record lists it"
            )
        if request.batch_size > self.limits.max_batch_size:
            raise wire.ProtocolError(
                f"batch_size {request.batch_size} exceeds this server's limit of "
                f"{self.limits.max_batch_size}"
            )
        if request.max_length > self.limits.max_session_length:
            raise wire.ProtocolError(
                f"max_length {request.max_length} exceeds this server's limit of "
                f"{self.limits.max_session_length} tokens"
            )

    async def _serve_steps(self, live: _LiveSession) -> None:
        """Steps from the client's own stream. With server-to-server push the client sends
        only to the first hop and this stream stays quiet while pushed steps arrive, so the
        idle deadline counts from the last step of either kind."""
        while True:
            try:
                message = await live.messages.receive(SESSION_IDLE_TIMEOUT_S)
            except Idle:
                if trio.current_time() - live.last_active < SESSION_IDLE_TIMEOUT_S:
                    continue
                raise
            if isinstance(message, wire.CloseSession):
                return
            if not isinstance(message, wire.Step):
                raise wire.ProtocolError(
                    f"expected Step or CloseSession in a session, got {type(message).__name__}"
                )
            await self._process(live, message)

    async def _process(self, live: _LiveSession, message: wire.Step) -> None:
        """Run one step; push the output on when the step names next hops (first, so the next
        server starts at once); answer the client on its session stream."""
        compression = live.request.reply_compression
        hidden = message.hidden_states
        size = hidden.numel() * hidden.element_size()
        with self.admission.inflight(live.messages.remote_peer, size):
            async with live.lock:
                live.last_active = trio.current_time()
                output = await self.run_step(
                    live.request, live.session, message, owner=live.messages.remote_peer
                )
        pushed = True
        if message.next_hops:
            pushed = await self._push(message, output, compression)
        await live.messages.send(
            wire.StepResult(
                session_id=live.request.session_id,
                step_id=message.step_id,
                hidden_states=output,
                push_failed=not pushed,
            ),
            compression,
        )

    # --- server-to-server push ------------------------------------------------------------

    async def handle_push(self, stream: ByteStream, remote_peer: str | None = None) -> None:
        """Steps pushed by the previous server of a client's route, for sessions the client
        opened here, each handed to its session's task (so one session's step never holds up
        another's). Nothing is answered on this stream: results go to the client."""
        messages = MessageStream(stream, self.limits.max_frame_size, remote_peer)
        try:
            while True:
                message = await messages.receive_as(wire.Step, SESSION_IDLE_TIMEOUT_S)
                live = self._live.get(message.session_id)
                if live is None:
                    log.info("pushed step for unknown session %s", message.session_id[:12])
                    continue
                try:
                    live.pushed[0].send_nowait(message)
                except trio.WouldBlock:
                    live.failure = Refused(
                        "bad_request",
                        f"more than {MAX_PUSHED_QUEUED} pushed steps wait for session "
                        f"{message.session_id[:12]}: send a session's next step only after its "
                        "result",
                    )
                    live.scope.cancel()
                except trio.BrokenResourceError:  # the session is ending
                    log.info("pushed step for closing session %s", message.session_id[:12])
        except (PeerGone, wire.ProtocolError) as e:
            log.debug("push stream from %s ended: %s", messages.remote_peer, e)
        finally:
            await messages.close()

    async def _serve_pushed(self, live: _LiveSession) -> None:
        """Run the steps pushed for one session, in the order they came; a failure ends the
        session (its client hears why on its own stream)."""
        async with live.pushed[1] as pushed:
            async for message in pushed:
                try:
                    await self._process(live, message)
                except wire.ProtocolError as e:
                    live.failure = Refused("bad_request", str(e))
                    live.scope.cancel()
                except Refused as e:
                    live.failure = e
                    live.scope.cancel()
                except PeerGone:  # the session's client went away; its handler cleans up
                    live.scope.cancel()

    async def _push(self, message: wire.Step, output: torch.Tensor, compression: str) -> bool:
        """Send our output to the next hop as its step; False if that failed."""
        target = message.next_hops[0]
        pushed = wire.Step(
            session_id=target.session_id,
            step_id=message.step_id,
            hidden_states=output,
            next_hops=message.next_hops[1:],
        )
        lock = self._push_locks.setdefault(target.peer_id, trio.Lock())
        try:
            async with lock:
                with trio.fail_after(PUSH_TIMEOUT_S):
                    stream = await self._push_stream(target)
                    await stream.send(pushed, compression)
            return True
        except Exception as e:  # any failure: the client relays this output itself
            log.info("push to %s failed: %s", target.peer_id, e)
            self._push_streams.pop(target.peer_id, None)
            return False

    async def _push_stream(self, target: wire.NextHop) -> MessageStream:
        stream = self._push_streams.get(target.peer_id)
        if stream is None:
            if self.node is None:
                raise PeerGone("this server has no host to push with")
            peer = ID.from_base58(target.peer_id)
            self.node.remember(peer, target.addrs)
            raw = await self.node.open_stream(peer, PUSH_PROTOCOL)
            stream = MessageStream(raw, self.limits.max_frame_size)
            self._push_streams[target.peer_id] = stream
        return stream

    # --- training: cache-less forward and backward ----------------------------------------

    async def handle_training(self, stream: ByteStream, remote_peer: str | None = None) -> None:
        """Forward and Backward requests, each answered in turn, until the client closes the
        stream or goes quiet. A bad request gets an Error and the stream goes on."""
        messages = MessageStream(stream, self.limits.max_frame_size, remote_peer)
        try:
            while True:
                request = await messages.receive(SESSION_IDLE_TIMEOUT_S)
                if not isinstance(request, wire.Forward | wire.Backward):
                    await self._refuse(
                        messages,
                        "bad_request",
                        f"expected Forward or Backward on the training protocol, got "
                        f"{type(request).__name__}",
                    )
                    continue
                try:
                    reply = await self.run_training(request)
                except wire.ProtocolError as e:
                    await self._refuse(messages, "bad_request", str(e))
                    continue
                await messages.send(reply, request.reply_compression)
        except wire.ProtocolError as e:  # framing broke: the stream cannot be trusted
            await self._refuse(messages, "bad_request", str(e))
        except PeerGone as e:
            log.debug("training stream from %s ended: %s", messages.remote_peer, e)
        finally:
            await messages.close()

    async def run_training(
        self, request: wire.Forward | wire.Backward
    ) -> wire.ForwardResult | wire.BackwardResult:
        """Check a Forward or Backward against this server's blocks and limits, then run it on
        the compute queue behind any inference step. ProtocolError says what was wrong."""
        if request.model != self.model:
            raise wire.ProtocolError(
                f"this server serves model {self.model!r}, not {request.model!r}"
            )
        if self.span is None or not (self.start <= request.start < request.end <= self.end):
            raise wire.ProtocolError(
                f"this server holds blocks {self.start}:{self.end} of {self.model} "
                f"({self.state.value}); it cannot run blocks {request.start}:{request.end}"
            )
        batch, tokens, width = request.hidden_states.shape
        if width != self.hidden_size:
            raise wire.ProtocolError(f"hidden_states must be {self.hidden_size} wide, got {width}")
        if batch * tokens > self.limits.max_training_tokens:
            raise wire.ProtocolError(
                f"{batch} x {tokens} tokens exceed this server's limit of "
                f"{self.limits.max_training_tokens} per training request: send smaller "
                "micro-batches"
            )
        span = self._span_for(request.start, request.end)
        self.counters.training_passes += 1
        self.counters.tokens_processed += batch * tokens
        if isinstance(request, wire.Forward):
            output = await self.compute.run(
                PRIORITY_TRAINING, _training_forward, span, request.hidden_states, request.prompts
            )
            return wire.ForwardResult(hidden_states=output)
        grad_inputs, grad_prompts = await self.compute.run(
            PRIORITY_TRAINING,
            _training_backward,
            span,
            request.hidden_states,
            request.grad_outputs,
            request.prompts,
        )
        return wire.BackwardResult(grad_inputs=grad_inputs, grad_prompts=grad_prompts)

    async def run_step(
        self,
        request: wire.OpenSession,
        session: SpanSession,
        message: wire.Step,
        owner: str = "",
    ) -> torch.Tensor:
        """Check one step against the session's limits, then run it on the compute queue, merged
        with concurrent steps of other sessions; `owner` (the client's peer) gets fair turns."""
        if self.span is None or not (self.start <= request.start and request.end <= self.end):
            raise wire.ProtocolError(
                f"this server now holds blocks {self.start}:{self.end} ({self.state.value}); "
                "open a session elsewhere"
            )
        hidden = self._check_step(message, request, session)
        if message.start_position is not None:
            session.rollback(message.start_position)
        span = self._span_for(request.start, request.end)
        output = await self.batcher.run(
            span, session, hidden, owner or self.peer_id, request.active_adapter
        )
        if self._corrupt_fraction and random.random() < self._corrupt_fraction:
            output = _corrupted(output)
        self.counters.steps += 1
        self.counters.tokens_processed += hidden.shape[0] * hidden.shape[1]
        return output

    def open_local(self, request: wire.OpenSession) -> LocalSession:
        """A session for this daemon's own clients: the same checks and cache as a remote one,
        without a stream (a host cannot dial itself)."""
        self._check_open(request)
        assert self.cache is not None
        session = self.cache.open_session(
            request.batch_size, request.max_length, request.left_padding or None
        )
        self.counters.sessions_opened += 1
        return LocalSession(self, request, session)

    def _check_step(
        self, message: wire.Step, request: wire.OpenSession, session: SpanSession
    ) -> torch.Tensor:
        hidden = message.hidden_states
        shape = tuple(hidden.shape)
        if len(shape) != 3 or shape[0] != request.batch_size or shape[2] != self.hidden_size:
            raise wire.ProtocolError(
                f"hidden_states must have shape [{request.batch_size}, tokens, "
                f"{self.hidden_size}], got {list(shape)}"
            )
        position = session.position
        if message.start_position is not None:
            if message.start_position > position:
                raise wire.ProtocolError(
                    f"start_position {message.start_position} is past the session's "
                    f"{position} cached tokens"
                )
            position = message.start_position
        if position + shape[1] > request.max_length:
            raise wire.ProtocolError(
                f"this step would bring the session to {position + shape[1]} tokens, past its "
                f"max_length of {request.max_length}; open a session with a larger max_length"
            )
        return hidden

    def _span_for(self, start: int, end: int) -> Span:
        """The loaded span, or a view of some of its blocks (sharing their weights) when a route
        uses only part of what this server holds."""
        assert self.span is not None
        if (start, end) == (self.start, self.end):
            return self.span
        if (start, end) not in self._subspans:
            self._subspans[(start, end)] = self.span.sub_span(start, end)
        return self._subspans[(start, end)]

    async def _refuse(self, messages: MessageStream, code: str, text: str) -> None:
        self.counters.error(code)
        log.info("refused a request from %s: %s", messages.remote_peer, text)
        with contextlib.suppress(PeerGone):
            await messages.send(wire.Error(code=code, message=text))

    def end_sessions(self) -> None:
        """Close every open session now; their clients see the stream end and re-route."""
        for scope in list(self._open_sessions):
            scope.cancel()

    def move_to(self, start: int, end: int) -> None:
        """Announce other blocks (state joining) until go_online with their span; the old
        span and its caches are dropped."""
        if self._open_sessions:
            raise RuntimeError("drain the open sessions before moving")
        self._start, self._end = start, end
        self.span, self.cache = None, None
        self._subspans.clear()
        self.state = ServerState.JOINING

    def drain(self) -> None:
        """Take no new sessions; open ones go on until they end or the daemon stops."""
        self.state = ServerState.DRAINING


def _training_forward(
    span: Span, hidden: torch.Tensor, prompts: torch.Tensor | None
) -> torch.Tensor:
    with torch.no_grad():
        return span(hidden, prompts=prompts)


def _training_backward(
    span: Span, hidden: torch.Tensor, grad_outputs: torch.Tensor, prompts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recompute the span's forward with autograd on (the server keeps nothing between a
    Forward and its Backward), then carry grad_outputs back to the inputs and prompts."""
    with torch.enable_grad():
        hidden = hidden.detach().to(span.dtype).requires_grad_(True)
        leaves = [hidden]
        if prompts is not None:
            prompts = prompts.detach().to(span.dtype).requires_grad_(True)
            leaves.append(prompts)
        output = span(hidden, prompts=prompts)
        grads = torch.autograd.grad(output, leaves, grad_outputs.to(output.dtype))
    return grads[0], grads[1] if prompts is not None else None


def _corrupted(output: torch.Tensor) -> torch.Tensor:
    """A lying server's output (PEERD_TEST_CORRUPT): noise of 5% of each token's largest value,
    small enough to look plausible, far past the verifier's tolerance."""
    scale = output.abs().amax(dim=-1, keepdim=True)
    return output + 0.05 * scale * torch.randn_like(output)


class LocalSession:
    """An inference session on our own BlockServer (see BlockServer.open_local)."""

    def __init__(self, server: BlockServer, request: wire.OpenSession, session: SpanSession):
        self.server = server
        self.request = request
        self.session = session
        self._steps = 0

    async def step(self, hidden: torch.Tensor, start_position: int | None) -> torch.Tensor:
        message = wire.Step(
            session_id=self.request.session_id,
            step_id=self._steps,
            hidden_states=hidden,
            start_position=start_position,
        )
        self._steps += 1
        return await self.server.run_step(self.request, self.session, message)

    def close(self) -> None:
        self.session.close()
        self.server.admission.cache_freed()
