"""Client side of distributed inference: one session over a chain of servers that survives the
death of any of them.

Each hop is one libp2p stream to one server holding a KV cache for blocks [start, end). The
client remembers every input it sent into each block boundary; when a hop fails, it bans the
server, plans a replacement for the failed blocks, replays the remembered inputs to rebuild the
replacement's cache, and carries on. The caller sees a slower step, never an error, as long as
some server holds each block.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch
import trio
from libp2p.peer.id import ID

import wire
from blocks import BlocksError, check_left_padding
from peerd.node.p2p import INFERENCE_PROTOCOL
from peerd.node.streams import MessageStream, PeerGone
from peerd.session.local import LocalSteps
from peerd.session.swarm import SwarmView
from peerd.session.verify import StepVerifier
from routing.planner import NoRouteError, RouteHop, format_route, plan_route
from wire.peer_protocol import CompressionName

log = logging.getLogger(__name__)

# A step of a 135M-parameter span answers in well under a second; a long prefill on a slow
# volunteer can take longer. Past this the hop counts as failed and is replaced.
# (RouteOptions.request_timeout overrides it per request.)
STEP_TIMEOUT_S = 60.0
# Dialing a server and opening a session on it (RouteOptions.connect_timeout overrides it).
OPEN_TIMEOUT_S = 10.0
# How long a session waits in a full server's queue for cache before trying another server.
ADMISSION_WAIT_S = 10.0
# How long to wait for the swarm to offer a route (servers may be restarting) before failing.
ROUTE_WAIT_S = 30.0
# Seconds past that deadline a refresh under way may take to finish (one info round trip).
INFO_GRACE_S = 3.0
# Failed servers one session replaces before it gives up (RouteOptions.max_retries overrides it).
MAX_HOP_FAILURES = 8


class HopRefused(PeerGone):
    """A live server answered our OpenSession with an error (busy, full, limits)."""


class WrongResult(PeerGone):
    """A server's output failed a spot check (peerd.session.verify): it is banned and replaced."""


class InferenceFailed(Exception):
    """The swarm could not finish a step: no server is left for some blocks, or too many failed."""


class AdapterUnavailable(InferenceFailed):
    """No server in the swarm offers the LoRA adapter a session asked for."""


@dataclass
class HopSession:
    """An open session on one server for blocks [start, end)."""

    hop: RouteHop
    stream: MessageStream
    session_id: str
    step_ids: itertools.count = field(default_factory=itertools.count)
    timeout: float = STEP_TIMEOUT_S

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    async def step(
        self, hidden: torch.Tensor, codec: CompressionName, start_position: int | None = None
    ) -> torch.Tensor:
        step_id = next(self.step_ids)
        await self.send_step(hidden, codec, step_id, start_position)
        return (await self.receive_result(step_id)).hidden_states

    async def send_step(
        self,
        hidden: torch.Tensor,
        codec: CompressionName,
        step_id: int,
        start_position: int | None = None,
        next_hops: tuple[wire.NextHop, ...] = (),
    ) -> None:
        await self.stream.send(
            wire.Step(
                session_id=self.session_id,
                step_id=step_id,
                hidden_states=hidden,
                start_position=start_position,
                next_hops=next_hops,
            ),
            codec,
        )

    async def receive_result(self, step_id: int) -> wire.StepResult:
        reply = await self.stream.receive(self.timeout)
        if isinstance(reply, wire.Error):
            raise PeerGone(f"{self.peer_id} refused the step: {reply.message}")
        if not isinstance(reply, wire.StepResult) or reply.step_id != step_id:
            raise PeerGone(f"{self.peer_id} answered step {step_id} with {reply!r:.80}")
        return reply

    def as_next_hop(self) -> wire.NextHop:
        return wire.NextHop(
            peer_id=self.peer_id,
            addrs=tuple(self.hop.record.addrs),
            session_id=self.session_id,
            start=self.hop.start,
            end=self.hop.end,
        )

    async def close(self) -> None:
        try:
            with trio.move_on_after(1):
                await self.stream.send(wire.CloseSession(session_id=self.session_id))
        except PeerGone:
            pass
        await self.stream.close()


@dataclass
class LocalHopSession:
    """A hop served by this daemon's own block server, called directly."""

    hop: RouteHop
    local: LocalSteps

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    async def step(
        self, hidden: torch.Tensor, codec: CompressionName, start_position: int | None = None
    ) -> torch.Tensor:
        try:
            return await self.local.step(hidden, start_position)
        except (BlocksError, ValueError) as e:
            raise wire.ProtocolError(str(e)) from e

    async def close(self) -> None:
        self.local.close()


Hop = HopSession | LocalHopSession


class InferenceSession:
    """Hidden states in, hidden states out, through every block of the model, with KV caches kept
    on the servers between steps. Use as `async with InferenceSession(...) as session:`."""

    def __init__(
        self,
        swarm: SwarmView,
        *,
        max_length: int,
        batch_size: int = 1,
        codec: CompressionName = "raw",
        push: bool = True,
        adapter: str | None = None,
        routing: wire.RouteOptions | None = None,
        verify_fraction: float | None = None,
        left_padding: tuple[int, ...] = (),
    ) -> None:
        """`routing`: which servers the session may use, how many failed ones it may replace,
        and how long dialing a hop and each step may take (None: the defaults above).
        `left_padding`: per row, padding positions at its start (a batch of prompts)."""
        if left_padding:  # ValueError: one count per row, each leaving room for a token
            check_left_padding(left_padding, batch_size, max_length)
        self.left_padding = tuple(left_padding)
        self.swarm = swarm
        self.adapter = adapter  # a LoRA adapter every hop applies (only servers listing it)
        routing = routing or wire.RouteOptions()
        allowed = routing.allowed_servers
        self.allowed_servers: frozenset[str] | None = (
            None if allowed is None else frozenset(allowed)
        )
        self.blocked_servers = frozenset(routing.blocked_servers)
        self.max_retries = MAX_HOP_FAILURES if routing.max_retries is None else routing.max_retries
        self.connect_timeout = routing.connect_timeout or OPEN_TIMEOUT_S
        self.request_timeout = routing.request_timeout or STEP_TIMEOUT_S
        self.push = push
        self._push_ids = itertools.count(1 << 40)  # apart from each hop's own step ids
        self.max_length = max_length
        self.batch_size = batch_size
        self.codec = codec
        self.hops: list[Hop] = []
        # inputs[b]: every hidden state sent into block b so far, concatenated over positions.
        self._inputs: dict[int, torch.Tensor] = {}
        self.position = 0
        self._rewind_to: int | None = None
        self.failures = 0
        # Spot checks of the servers' results (the daemon's --verify unless given here).
        fraction = swarm.verify_fraction if verify_fraction is None else verify_fraction
        self.verifier: StepVerifier | None = None
        if fraction > 0:
            self.verifier = StepVerifier(
                swarm,
                fraction,
                self._open_hop,
                codec=codec,
                session_tokens=batch_size * max_length,
                adapter=adapter,
                allowed=self.allowed_servers,
                blocked=self.blocked_servers,
            )

    async def __aenter__(self) -> InferenceSession:
        if self.adapter is not None:
            await self._check_adapter_offered(self.adapter)
        await self._open_route(0, self.swarm.num_blocks)
        return self

    async def _check_adapter_offered(self, adapter: str) -> None:
        """Fail at once, not after ROUTE_WAIT_S, when no server in the swarm has the adapter."""
        for attempt in range(2):
            offered = {name for r in self.swarm.snapshot().records for name in r.adapters}
            if adapter in offered:
                return
            if attempt == 0:
                await self.swarm.refresh()
        listed = ", ".join(sorted(offered)) or "none"
        raise AdapterUnavailable(
            f"no server of {self.swarm.model} offers adapter {adapter!r} (adapters in the swarm: "
            f"{listed}); start servers with `peerd start --adapters DIR` where DIR's name is "
            f"{adapter!r}"
        )

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            for hop in self.hops:
                await hop.close()
            if self.verifier is not None:
                await self.verifier.close()
        self.hops = []

    @property
    def route(self) -> list[RouteHop]:
        return [h.hop for h in self.hops]

    def describe_route(self) -> str:
        return format_route(tuple(self.route))

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run [batch, tokens, hidden] through all blocks, extending every server's cache."""
        if hidden.shape[0] != self.batch_size:
            raise ValueError(
                f"this session has batch size {self.batch_size}, got {hidden.shape[0]}"
            )
        if self.position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"this step would reach {self.position + hidden.shape[1]} tokens, past the "
                f"session's max_length of {self.max_length}"
            )
        # After a rollback every hop is told where the new tokens start (once per hop).
        rewind = self._rewind_to
        first_position = self.position
        i = 0
        remote = all(isinstance(hop, HopSession) for hop in self.hops)
        if self.push and rewind is None and remote and len(self.hops) > 1:
            i, hidden = await self._push_step(hidden)
            if i < len(self.hops):
                # The chain broke. A server past the break may still have got the push (its
                # pusher died after sending): starting the relayed step at our position rolls
                # such a cache back instead of appending the tokens twice.
                rewind = self.position
        hidden = await self._relay(i, hidden, rewind)
        if self.verifier is not None:
            hidden = await self._verify(hidden, first_position)
        self._rewind_to = None
        self.position += hidden.shape[1]
        return hidden

    async def _relay(self, i: int, hidden: torch.Tensor, rewind: int | None) -> torch.Tensor:
        """Client-relayed: each hop from `i` on in turn (all of them without push, or from
        where a push chain broke); returns the last hop's output."""
        while i < len(self.hops):
            hop = self.hops[i]
            try:
                output = await hop.step(hidden, self.codec, rewind)
            except (PeerGone, wire.ProtocolError) as e:
                await self._replace(i, e)
                continue  # the replacement hops start at the same block: retry with `hidden`
            self._remember(hop.hop.start, hidden)
            self.swarm.report_success(hop.peer_id)
            hidden = output
            i += 1
        return hidden

    async def _verify(self, output: torch.Tensor, first_position: int) -> torch.Tensor:
        """Spot-check this step's hops (peerd.session.verify). A hop caught lying is replaced, and
        the
        step re-runs from it on honest servers (the later hops roll their caches back to
        `first_position`), so the output returned is the honest one."""
        assert self.verifier is not None
        end_position = first_position + output.shape[1]
        i = 0
        while i < len(self.hops):
            hop = self.hops[i]
            if not isinstance(hop, HopSession) or not self.verifier.wants(hop):
                i += 1
                continue
            start = hop.hop.start
            history = self._inputs[start][:, :end_position]
            if i + 1 < len(self.hops):
                claimed = self._inputs[self.hops[i + 1].hop.start][:, first_position:end_position]
            else:
                claimed = output
            liar = await self.verifier.check(hop, history, claimed)
            if liar is None:
                i += 1
                continue
            step_input = history[:, first_position:]
            self._forget(start, first_position)
            await self._replace(i, WrongResult(f"{liar} failed a spot check"))
            output = await self._relay(i, step_input, first_position)
        return output

    def _forget(self, first_block: int, position: int) -> None:
        """Drop the remembered inputs of blocks from `first_block` on, from `position` on."""
        for block in list(self._inputs):
            if block >= first_block:
                if position == 0:
                    del self._inputs[block]
                else:
                    self._inputs[block] = self._inputs[block][:, :position]

    async def _push_step(self, hidden: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Send the step to the first hop naming the rest: each server pushes its output to
        the next and also answers us, so a step costs one pass through the chain and we still
        hold every hop's input for failover. Returns (first hop not done, its input)."""
        hops = [hop for hop in self.hops if isinstance(hop, HopSession)]
        step_id = next(self._push_ids)
        chain = tuple(hop.as_next_hop() for hop in hops[1:])
        try:
            await hops[0].send_step(hidden, self.codec, step_id, next_hops=chain)
        except PeerGone:
            return 0, hidden  # the relay loop retries hop 0 and replaces it if it is gone
        for i, hop in enumerate(hops):
            try:
                result = await hop.receive_result(step_id)
            except (PeerGone, wire.ProtocolError):
                return i, hidden
            self._remember(hop.hop.start, hidden)
            self.swarm.report_success(hop.peer_id)
            hidden = result.hidden_states
            if result.push_failed and i + 1 < len(hops):
                return i + 1, hidden
        return len(hops), hidden

    def rollback(self, position: int) -> None:
        """Forget every token from `position` on: the next step continues from there (the
        servers roll their caches back when it arrives)."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot roll back to {position}: the session holds {self.position}")
        self.position = position
        self._rewind_to = position
        for block, inputs in self._inputs.items():
            self._inputs[block] = inputs[:, :position]

    def _remember(self, block: int, hidden: torch.Tensor) -> None:
        past = self._inputs.get(block)
        self._inputs[block] = hidden if past is None else torch.cat([past, hidden], dim=1)

    async def _replace(self, index: int, error: Exception) -> None:
        """Swap the failed hop at `index` for fresh hops over the same blocks, with their caches
        rebuilt from the remembered inputs."""
        failed = self.hops[index]
        started = time.perf_counter()
        self.failures += 1
        log.warning(
            "server %s failed on blocks %d:%d (%s); re-routing",
            failed.peer_id,
            failed.hop.start,
            failed.hop.end,
            error,
        )
        self.swarm.report_failure(failed.peer_id)
        self._check_retries(error)
        with trio.CancelScope(shield=True):
            await failed.close()
        start, end = failed.hop.start, failed.hop.end
        history = self._inputs.get(start)
        while True:
            new_hops = await self._open_hops(start, end)
            try:
                await self._replay(new_hops, start, history)
                break
            except (PeerGone, wire.ProtocolError) as e:
                # A replacement died while rebuilding its cache: ban it and try others.
                self.failures += 1
                for hop in new_hops:
                    self.swarm.report_failure(hop.peer_id)
                with trio.CancelScope(shield=True):
                    for hop in new_hops:
                        await hop.close()
                self._check_retries(e)
        self.hops[index : index + 1] = new_hops
        log.info(
            "blocks %d:%d moved from %s to %s: %d tokens replayed in %.2f s",
            start,
            end,
            failed.peer_id,
            ", ".join(h.peer_id for h in new_hops),
            0 if history is None else int(history.shape[1]),
            time.perf_counter() - started,
        )

    def _check_retries(self, error: Exception) -> None:
        """Give up once more servers failed than max_retries allows replacing."""
        if self.failures > self.max_retries:
            raise InferenceFailed(
                f"{self.failures} server failure(s) in this session, more than max_retries="
                f"{self.max_retries} allows; giving up (last: {error}). Retry, or allow more "
                "retries"
            ) from error

    async def _replay(self, hops: list[Hop], start: int, history: torch.Tensor | None) -> None:
        """Rebuild the caches of fresh hops over blocks from `start` by running the remembered
        inputs through them, remembering the inputs of any new block boundary on the way."""
        if history is None:
            return
        hidden = history
        for hop in hops:
            if hop.hop.start != start:
                self._inputs[hop.hop.start] = hidden
            try:
                hidden = await hop.step(hidden, self.codec)
            except (PeerGone, wire.ProtocolError):
                self.swarm.report_failure(hop.peer_id)
                raise

    async def _open_route(self, start: int, end: int) -> None:
        self.hops = await self._open_hops(start, end)

    async def _open_hops(self, start: int, end: int) -> list[Hop]:
        """Plan [start, end) and open a session on each hop, re-planning around servers that
        refuse or fail to open, until a route opens or no server is left.

        A server that fails (unreachable, broken stream) is banned for everyone; one that is
        alive but refuses (full cache, too many sessions from us) is only skipped by this
        session for a moment: it is healthy for other clients and may have room soon."""
        deadline = trio.current_time() + ROUTE_WAIT_S
        refused: set[str] = set()
        while True:
            try:
                route = self.swarm.plan(
                    start,
                    end,
                    min_free_cache_tokens=self.batch_size * self.max_length,
                    session_length=self.max_length,
                    allowed_servers=self.allowed_servers,
                    blocked_servers=refused | self.blocked_servers,
                    adapter=self.adapter,
                )
            except NoRouteError as e:
                if trio.current_time() > deadline:
                    why = self.swarm.explain_unreachable(e.missing)
                    raise InferenceFailed(f"{e}; {why}" if why else str(e)) from e
                refused.clear()  # try the busy ones again after a pause
                # A refresh can take long when the DHT nodes are gone (block look-ups time out
                # one by one): wait for a route until the deadline, not for the refresh.
                with trio.move_on_after(max(0.0, deadline - trio.current_time()) + INFO_GRACE_S):
                    await self.swarm.refresh()
                self._check_allowed_cover(start, end)
                await trio.sleep(0.5)
                continue
            opened: list[Hop] = []
            try:
                for hop in route:
                    opened.append(await self._open_hop(hop))
                return opened
            except (PeerGone, wire.ProtocolError, OSError, Exception) as e:
                bad = route[len(opened)].peer_id
                log.warning("could not open a session on %s: %s", bad, e)
                if isinstance(e, HopRefused):
                    refused.add(bad)
                else:
                    self.swarm.report_failure(bad)
                    self.failures += 1
                with trio.CancelScope(shield=True):
                    for hop_session in opened:
                        await hop_session.close()
                self._check_retries(e)
                if trio.current_time() > deadline:
                    raise InferenceFailed(
                        f"could not open a route over blocks {start}:{end}: {e}"
                    ) from e

    def _check_allowed_cover(self, start: int, end: int) -> None:
        """Raise NoRouteError at once when the caller's allowed_servers leave some of blocks
        [start, end) to servers outside it: waiting for the swarm cannot fix that."""
        if self.allowed_servers is None:
            return
        try:
            plan_route(
                self.swarm.snapshot(),
                start,
                end,
                allowed_servers=self.allowed_servers,
                blocked_servers=self.blocked_servers,
            )
        except NoRouteError as e:
            if e.due_to_allowed_servers:
                raise

    async def _open_hop(self, hop: RouteHop) -> Hop:
        request = wire.OpenSession(
            session_id=uuid.uuid4().hex,
            model=self.swarm.model,
            start=hop.start,
            end=hop.end,
            max_length=self.max_length,
            batch_size=self.batch_size,
            reply_compression=self.codec,
            active_adapter=self.adapter,
            wait_timeout=ADMISSION_WAIT_S,
            left_padding=self.left_padding,
        )
        local = self.swarm.local_server
        if local is not None and hop.peer_id == local.peer_id:
            try:
                return LocalHopSession(hop, local.open_local(request))
            except (BlocksError, wire.ProtocolError) as e:
                raise HopRefused(f"our own server refused the session: {e}") from e
        peer = ID.from_base58(hop.peer_id)
        self.swarm.node.remember(peer, hop.record.addrs)
        deadline = trio.current_time() + self.connect_timeout
        with trio.fail_after(self.connect_timeout):
            raw = await self.swarm.node.open_stream(peer, INFERENCE_PROTOCOL)
        stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
        await stream.send(request)
        # The reply may take the connect time plus the time we offered to wait in its queue.
        reply = await stream.receive(max(0.0, deadline - trio.current_time()) + ADMISSION_WAIT_S)
        if isinstance(reply, wire.Error):
            await stream.close()
            raise HopRefused(f"{hop.peer_id} refused the session: {reply.message}")
        if not isinstance(reply, wire.SessionOpened):
            await stream.close()
            raise wire.ProtocolError(f"expected SessionOpened, got {type(reply).__name__}")
        return HopSession(
            hop=hop, stream=stream, session_id=request.session_id, timeout=self.request_timeout
        )
