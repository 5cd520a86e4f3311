"""The block server: serves one span of a model to anyone over the info, inference, push and
training protocols.

It never runs code from the network: only its own blocks' forward, on tensors whose sizes it has
checked against its limits before allocating anything for them. This module holds the server's
state and the checks every step and session goes through; the conversations are in
peerd.server.sessions (inference), .push (server to server), .training and .local_session (our
own daemon's sessions), each stream behind the fault boundary of peerd.server.boundary.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import wire
from blocks import MemoryCache, Span, SpanSession
from peerd import __version__
from peerd.node.p2p import Node
from peerd.node.streams import ByteStream, MessageStream
from peerd.server import boundary, training
from peerd.server.admission import (
    LEASE_IDLE_S,
    LEASE_TERM_S,
    MAX_CACHE_SHARE,
    MAX_TRAINING_INFLIGHT,
    MAX_TRAINING_PER_PEER,
    AdapterMissing,
    Admission,
)
from peerd.server.batching import MAX_BATCH_ROWS, StepBatcher
from peerd.server.boundary import OPEN_TIMEOUT_S, stream_boundary
from peerd.server.compute import ComputeQueue
from peerd.server.local_session import LocalSession
from peerd.server.priority import Priority
from peerd.server.push import Pusher
from peerd.server.sessions import InferenceHandler
from peerd.server.standing import Standing
from routing.records import ServerRecord, ServerState, record_to_info
from wire.conversation import MAX_PUSHED_QUEUED, ServerInference
from wire.peer_protocol import DEFAULT_SESSIONS_PER_PEER

__all__ = [
    "MAX_PUSHED_QUEUED",
    "TEST_CORRUPT_ENV",
    "AdapterMissing",
    "BlockServer",
    "ServerCounters",
    "ServerLimits",
]

log = logging.getLogger(__name__)

# TESTS ONLY: a server started with PEERD_TEST_CORRUPT=F adds noise to a fraction F of its
# step outputs, so tests can check that clients catch a lying server (peerd.session.verify). Nothing
# else sets it; docs/operations.md says never to.
TEST_CORRUPT_ENV = "PEERD_TEST_CORRUPT"


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
    # Cache leases (peerd.server.admission): when a request waits for cache, a session that
    # sent no step for lease_idle_s, or has held its tokens for lease_term_s, is ended for it.
    lease_idle_s: float = LEASE_IDLE_S
    lease_term_s: float = LEASE_TERM_S
    # The share of the cache the sessions of one peer may hold or wait for.
    max_cache_share: float = MAX_CACHE_SHARE
    # Training requests queued or running: per peer, and of all peers together.
    max_training_per_peer: int = MAX_TRAINING_PER_PEER
    max_training_inflight: int = MAX_TRAINING_INFLIGHT
    # Rows one merged forward of several sessions' steps may take (peerd start --max-batch-size);
    # a session's own step, up to max_batch_size rows, always runs, alone if need be.
    max_merged_rows: int = MAX_BATCH_ROWS


@dataclass
class ServerCounters:
    sessions_opened: int = 0
    sessions_refused: int = 0
    steps: int = 0
    tokens_processed: int = 0
    training_passes: int = 0  # forward and backward requests run
    training_slices: int = 0  # compute jobs of those (one block over a group of rows each)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1


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
        public_name: str = "",
        priority: str = "standing",
    ) -> None:
        # What each requesting peer contributes to this model (fed by the daemon's swarm view),
        # and who goes first by it when loaded (peerd.server.priority; fifo: counted only).
        self.standing = Standing()
        self.model = model
        self.swarm_name = swarm_name
        self.public_name = public_name
        self.adapters = adapters  # LoRA adapters the span is loaded with (named in the record)
        self._start, self._end = start, end
        self.compute = compute
        self.limits = limits or ServerLimits()
        self.batcher = self._batcher(batching, priority)
        self.peer_id = peer_id
        self.addrs = addrs
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
            lease_idle_s=self.limits.lease_idle_s,
            lease_term_s=self.limits.lease_term_s,
            max_cache_share=self.limits.max_cache_share,
            max_training_per_peer=self.limits.max_training_per_peer,
            max_training_inflight=self.limits.max_training_inflight,
            priority=self._priority(priority),
        )
        self.training_pace = training.TrainingPace()  # how fast training slices run here
        self._subspans: dict[tuple[int, int], Span] = {}
        self.node = node
        self.sessions = InferenceHandler(self, Pusher(node, self.limits.max_frame_size))
        self._corrupt_fraction = float(os.environ.get(TEST_CORRUPT_ENV) or 0.0)
        if self._corrupt_fraction:
            log.warning("%s is set: this server returns WRONG results", TEST_CORRUPT_ENV)

    def _batcher(self, batching: bool, priority: str) -> StepBatcher:
        """Concurrent steps of different sessions share a forward of at most
        limits.max_merged_rows rows (batching=False: one each)."""
        rows = self.limits.max_merged_rows
        if rows < 1:
            raise ValueError(f"max_merged_rows {rows}: give 1 or more")
        return StepBatcher(
            self.compute, enabled=batching, max_rows=rows, priority=self._priority(priority)
        )

    def _priority(self, mode: str) -> Priority:
        if mode not in ("standing", "fifo"):
            raise ValueError(f"priority must be 'standing' or 'fifo', not {mode!r}")
        return Priority(self.standing, enabled=mode == "standing")

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
            public_name=self.public_name,
            updated_at=now,
            expires_at=now + self.record_ttl,
            **self._serving_fields(),
        )

    def _serving_fields(self) -> dict[str, str]:
        """The loaded span's device, dtype and quantization for the record (none while joining)."""
        if self.span is None:
            return {}
        dtype = str(self.span.dtype).removeprefix("torch.")
        return {"device": str(self.span.device), "dtype": dtype, "quant": self.span.quant}

    def _free_cache_tokens(self) -> int:
        """Free cache, plus what lapsed leases would give up for a waiting request, less what the
        queued requests wait for: routing should not send a new session to a server whose free
        cache is already promised, nor skip one whose cache is only held by idle sessions."""
        if self.cache is None:
            return 0
        free = self.cache.free_tokens + self.admission.reclaimable_tokens()
        return max(0, free - self.admission.queued_tokens)

    @property
    def open_sessions(self) -> int:
        return len(self.sessions.scopes)

    # --- the protocols: one handler per stream ----------------------------------------------

    async def handle_info(self, stream: ByteStream, remote_peer: str | None = None) -> None:
        messages = MessageStream(stream, self.limits.max_frame_size, remote_peer)
        async with stream_boundary(self, messages, "info"):
            await messages.receive_as(wire.InfoRequest, OPEN_TIMEOUT_S)
            await messages.send(wire.InfoResponse(record=record_to_info(self.record())))

    async def handle_inference(self, stream: ByteStream, remote_peer: str | None = None) -> None:
        """One stream = one session (peerd.server.sessions)."""
        await self.sessions.handle(
            MessageStream(
                stream, self.limits.max_frame_size, remote_peer, check_tensor=self.check_tensor
            )
        )

    async def handle_push(self, stream: ByteStream, remote_peer: str | None = None) -> None:
        """Steps pushed by the previous server of a client's route (peerd.server.push)."""
        messages = MessageStream(
            stream, self.limits.max_frame_size, remote_peer, check_tensor=self.check_tensor
        )
        await self.sessions.pushes.handle(messages)

    async def handle_training(self, stream: ByteStream, remote_peer: str | None = None) -> None:
        """Forward and Backward requests, each answered in turn (peerd.server.training)."""
        messages = MessageStream(
            stream, self.limits.max_frame_size, remote_peer, check_tensor=self.check_tensor
        )
        await training.handle_training(self, messages)

    async def run_training(
        self, request: wire.Forward | wire.Backward
    ) -> wire.ForwardResult | wire.BackwardResult:
        """Run a Forward or Backward on this server's blocks (peerd.server.training)."""
        return await training.run_training(self, request)

    async def refuse(self, messages: MessageStream, code: wire.ErrorCode, text: str) -> None:
        """Answer an Error (counted by code) and go on: the peer may be gone already."""
        self.counters.error(code)
        await boundary.refuse(messages, code, text)

    # --- what every session and step is checked against -------------------------------------

    def check_tensor(self, path: str, shape: list[int]) -> None:
        """A received tensor's shape, before its data is copied or decompressed: as wide as our
        blocks, and no more rows than any request here may carry (ValueError: refused)."""
        if self.hidden_size and (not shape or shape[-1] != self.hidden_size):
            raise ValueError(f"must be {self.hidden_size} wide (this server's hidden size)")
        limits = self.limits
        rows = max(limits.max_batch_size * limits.max_session_length, limits.max_training_tokens)
        if len(shape) > 3:  # deep prompts: one [batch, prefix] per block
            rows *= self.end - self.start
        if math.prod(shape[:-1]) > rows:
            raise ValueError(
                f"shape {shape} has more rows than this server takes in one request ({rows})"
            )

    def check_open(self, request: wire.OpenSession) -> None:
        """ProtocolError (AdapterMissing for a missing adapter) if this server cannot take the
        session `request` asks for."""
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
        self._check_size(request)

    def _check_size(self, request: wire.OpenSession) -> None:
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

    async def run_step(
        self,
        conv: ServerInference,
        session: SpanSession,
        message: wire.Step,
        owner: str = "",
        pushed: bool = False,
    ) -> torch.Tensor | None:
        """Check one step against the span and the session's conversation (order, positions),
        then run it on the compute queue, merged with concurrent steps of other sessions;
        `owner` (the client's peer) gets fair turns. None: a stale pushed step, dropped."""
        request = conv.request
        assert request is not None
        if self.span is None or not (self.start <= request.start and request.end <= self.end):
            raise wire.ProtocolError(
                f"this server now holds blocks {self.start}:{self.end} ({self.state.value}); "
                "open a session elsewhere"
            )
        hidden = self._check_shape(message, request)
        if not conv.start_step(message, pushed=pushed):
            log.info("dropped a stale pushed step %d of %s", message.step_id, request.session_id)
            return None
        if message.start_position is not None:
            session.rollback(message.start_position)
        span = self.span_for(request.start, request.end)
        output = await self.batcher.run(
            span,
            session,
            hidden,
            owner or self.peer_id,
            request.active_adapter,
            micro_batch=message.micro_batch,
        )
        if self._corrupt_fraction and random.random() < self._corrupt_fraction:
            output = _corrupted(output)
        self.counters.steps += 1
        self.counters.tokens_processed += hidden.shape[0] * hidden.shape[1]
        return output

    def _check_shape(self, message: wire.Step, request: wire.OpenSession) -> torch.Tensor:
        hidden = message.hidden_states
        shape = tuple(hidden.shape)
        if len(shape) != 3 or shape[0] != request.batch_size or shape[2] != self.hidden_size:
            raise wire.ProtocolError(
                f"hidden_states must have shape [{request.batch_size}, tokens, "
                f"{self.hidden_size}], got {list(shape)}"
            )
        return hidden

    def open_local(self, request: wire.OpenSession) -> LocalSession:
        """A session for this daemon's own clients: the same checks and cache as a remote one,
        without a stream (a host cannot dial itself)."""
        self.check_open(request)
        assert self.cache is not None
        session = self.cache.open_session(
            request.batch_size, request.max_length, request.left_padding or None
        )
        self.counters.sessions_opened += 1
        return LocalSession(self, request, session)

    def span_for(self, start: int, end: int) -> Span:
        """The loaded span, or a view of some of its blocks (sharing their weights) when a route
        uses only part of what this server holds."""
        assert self.span is not None
        if (start, end) == (self.start, self.end):
            return self.span
        if (start, end) not in self._subspans:
            self._subspans[(start, end)] = self.span.sub_span(start, end)
        return self._subspans[(start, end)]

    # --- the daemon's controls --------------------------------------------------------------

    def end_sessions(self) -> None:
        """Close every open session now; their clients see the stream end and re-route."""
        for scope in list(self.sessions.scopes):
            scope.cancel()

    def move_to(self, start: int, end: int) -> None:
        """Announce other blocks (state joining) until go_online with their span; the old
        span and its caches are dropped."""
        if self.sessions.scopes:
            raise RuntimeError("drain the open sessions before moving")
        self._start, self._end = start, end
        self.span, self.cache = None, None
        self._subspans.clear()
        self.state = ServerState.JOINING

    def drain(self) -> None:
        """Take no new sessions; open ones go on until they end or the daemon stops."""
        self.state = ServerState.DRAINING


def _corrupted(output: torch.Tensor) -> torch.Tensor:
    """A lying server's output (PEERD_TEST_CORRUPT): noise of 5% of each token's largest value,
    small enough to look plausible, far past the verifier's tolerance."""
    scale = output.abs().amax(dim=-1, keepdim=True)
    return output + 0.05 * scale * torch.randn_like(output)
