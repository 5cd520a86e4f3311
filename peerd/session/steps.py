"""Step running for one inference session: push a step down the chain of hops (each server
forwards its output to the next and answers us too) or relay it hop by hop ourselves, collecting
every hop's output, then hand the step's output to the hooks (spot checks) that may change it.

A hop that fails mid-step is handed to the route keeper to replace, and the step goes on from
that hop on the replacement. Every reply is held to its step's input shape and to finite values
(wire.conversation.ClientInference) before it is used. A hop that a push reached ran on what
the server before it sent, which we never saw: when it fails in a way that bad input could
cause (an error reply, a wrong reply, silence), it is not blamed (hops.Unattributed); only a
hop that fails on a step we sent it ourselves is.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import torch
import trio

import wire
from peerd.node.streams import Idle
from peerd.session.hops import (
    PEER_FAULTS,
    FirstStep,
    HopSession,
    LeaseLapsed,
    StepRefused,
    Unattributed,
    last_positions,
)
from peerd.session.route import RouteKeeper
from routing.planner import RouteHop
from wire.conversation import MAX_PUSHED_QUEUED
from wire.peer_protocol import CompressionName

# Called after each step with (the step's output, the position of its first token, the position
# after its last); returns the output to use (a spot check that caught a liar re-runs the step and
# returns the honest one). The output may be the last positions only (StepRunner.run's keep_last).
StepHook = Callable[[torch.Tensor, int, int], Awaitable[torch.Tensor]]

# A pushed step of at least twice a chunk's tokens (a prompt) flows through the chain in chunks
# of at least that many, at most PIPELINE_MAX_CHUNKS of them: the second server starts on the
# first chunk while the first server computes the next (see pipeline_chunks). A chunk must be
# long enough that its pass costs about its share of the whole prompt's, though each pass reads
# every weight again: on a CPU from a few dozen tokens (a 252-token prompt through two servers of
# 15 blocks of the default model, each on a core of its own: chunks of 63, 84 and 126 tokens took
# the first token 1.16x, 1.23x and 1.19x sooner than the prompt whole); a GPU runs a pass of
# hundreds of tokens in about the time of one, so there chunks pay only for long prompts (not
# measured: 512 is a guess).
PIPELINE_CHUNK_TOKENS = 64
PIPELINE_CHUNK_TOKENS_GPU = 512
PIPELINE_MAX_CHUNKS = 4
assert PIPELINE_MAX_CHUNKS <= MAX_PUSHED_QUEUED  # a server queues that many pushed steps


def pipeline_chunks(tokens: int, route: Sequence[RouteHop], pipeline: bool | None) -> int:
    """How many chunks a pushed step of `tokens` tokens a row goes through `route` in (1: whole).

    Chunks pay where the hops compute at the same time on hardware of their own: hop 2 runs
    chunk 1 while hop 1 runs chunk 2, so a prompt in k chunks through n hops takes about
    (n - 1 + k) / k of one hop's pass instead of n (plus a message per chunk and hop). Servers
    that share a machine share its cores, so there chunks slow the prompt down (three daemons
    on one 2-core machine: the first token 1.7-2.1x later): `pipeline` None (auto) leaves a route
    whole when two of its servers announce an address on the same host (a local swarm, or
    servers behind one NAT); True pipelines anyway, False never."""
    if pipeline is False or len(route) < 2:
        return 1
    if pipeline is None and _shares_a_host(route):
        return 1
    gpu = any(hop.record.device.startswith(("cuda", "mps")) for hop in route)
    chunk = PIPELINE_CHUNK_TOKENS_GPU if gpu else PIPELINE_CHUNK_TOKENS
    return max(1, min(PIPELINE_MAX_CHUNKS, tokens // chunk))


def _shares_a_host(route: Sequence[RouteHop]) -> bool:
    """Whether two hops' servers announce addresses on one host (relay addresses aside: the
    relay's host is not theirs)."""
    seen: set[str] = set()
    for hop in route:
        hosts = {
            parts[2]
            for addr in hop.record.addrs
            if "/p2p-circuit" not in addr
            and len(parts := addr.split("/")) > 2
            and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6")
        }
        if hosts & seen:
            return True
        seen |= hosts
    return False


class StepRunner:
    """Runs steps through the hops a RouteKeeper holds."""

    def __init__(
        self,
        route: RouteKeeper,
        codec: CompressionName,
        push: bool,
        pipeline: bool | None = None,
    ) -> None:
        self.route = route
        self.codec = codec
        self.push = push
        # Long pushed steps in chunks (pipeline_chunks); None: the swarm view's pipeline_prompts
        # (the daemon's --pipeline-prompts), which None leaves to pipeline_chunks' own judgement.
        self.pipeline = pipeline
        self.hooks: list[StepHook] = []
        # The group of the client's concurrent sessions the next steps belong to
        # (wire.Step.micro_batch; set by the generation that runs them); None: merged with any.
        self.micro_batch: int | None = None
        self.keep_last: int | None = None  # of the step under way (run's keep_last)

    async def run(
        self,
        hidden: torch.Tensor,
        first_position: int,
        rewind: int | None,
        keep_last: int | None = None,
    ) -> torch.Tensor:
        """Run [batch, tokens, hidden] starting at `first_position` through every hop; with
        `rewind`, every hop is told where the tokens start (rolling back what it holds past
        it). `keep_last`: return the output's last positions only, and have the route's last
        server send only those back (wire.Step.reply_last)."""
        self.keep_last = keep_last
        end_position = first_position + int(hidden.shape[1])
        i = 0
        pushing = self.push and self.route.pushing
        if self.route.deferred:  # the session's first step opens its route
            first = None
            chunks: list[torch.Tensor] = []
            if pushing and rewind is None:
                chunks = self._chunks(hidden, self.route.planned)
                step_id = next(self.route.step_ids)
                first = FirstStep(chunks[0], step_id, self.micro_batch, self._reply_last(chunks))
            await self.route.open_with(first)
            if first is not None and first.sent:  # every hop is remote then
                carried = [hop for hop in self.route.hops if isinstance(hop, HopSession)]
                if len(chunks) > 1:
                    i, hidden = await self._pipeline(carried, chunks, first.step_id, first_position)
                else:
                    i, hidden = await self._collect(
                        carried, first.step_id, hidden, None, first.reply_last
                    )
                if i < len(self.route.hops):
                    rewind = first_position  # (as below)
                pushing = False  # done: relay from the break, if it broke
        hops = self.route.hops
        remote = all(isinstance(hop, HopSession) for hop in hops)
        if pushing and remote and len(hops) > 1:
            chunks = self._chunks(hidden, [hop.hop for hop in hops]) if rewind is None else []
            chain = self._chain()
            if len(chunks) > 1 and len(chain) == len(hops):
                i, hidden = await self._pipeline(chain, chunks, None, first_position)
            else:
                # A rewind rides the push: every server passes the start position on with its
                # output, so a rollback (speculative decoding's rejected drafts) costs no round
                # trip.
                i, hidden = await self._push_step(hidden, rewind)
            if i < len(hops):
                # The chain broke. A server past the break may still have got the push (its
                # pusher died after sending): starting the relayed step at our position rolls
                # such a cache back instead of appending the tokens twice.
                rewind = first_position
        hidden = await self.relay(i, hidden, rewind)
        for hook in self.hooks:
            hidden = await hook(hidden, first_position, end_position)
        return last_positions(hidden, keep_last)

    def _reply_last(self, chunks: Sequence[torch.Tensor]) -> int | None:
        """The step's reply_last for a chain that covers the whole route, the step sent as
        `chunks`: keep_last, where the last chunk holds that many positions (each chunk's reply
        is then cut alike, and the last one's holds them all)."""
        keep = self.keep_last
        return keep if keep is not None and keep <= chunks[-1].shape[1] else None

    async def relay(self, i: int, hidden: torch.Tensor, rewind: int | None) -> torch.Tensor:
        """Client-relayed: each hop from `i` on in turn (all of them without push, or from
        where a push chain broke); returns the last hop's output."""
        hops = self.route.hops
        while i < len(hops):
            hop = hops[i]
            sent = time.perf_counter()
            last = self.keep_last if i == len(hops) - 1 else None
            try:
                output = await hop.step(hidden, self.codec, rewind, self.micro_batch, last)
            except PEER_FAULTS as e:
                await self.route.replace(i, e)
                continue  # the replacement hops start at the same block: retry with `hidden`
            self.route.remember(hop.hop.start, hidden)
            self.route.swarm.report_success(hop.peer_id)
            _record_step(self.route, hop.hop, hidden, sent)
            hidden = output
            i += 1
        return hidden

    async def _push_step(
        self, hidden: torch.Tensor, rewind: int | None = None
    ) -> tuple[int, torch.Tensor]:
        """Send the step to the first hop naming the rest: each server pushes its output to
        the next and also answers us, so a step costs one pass through the chain and we still
        hold every hop's input for failover. Returns (first hop not done, its input).

        The chain ends before a hop that takes pushes from another peer than the hop before it
        (it named a server since replaced): that hop would drop the push, so we relay to it."""
        hops = self._chain()
        step_id = next(self.route.step_ids)
        chain = tuple(hop.as_next_hop() for hop in hops[1:])
        # Cut only where the chain ends the route: else its last output is a relayed hop's input.
        last = self._reply_last([hidden]) if len(hops) == len(self.route.hops) else None
        sent = time.perf_counter()
        try:
            await hops[0].send_step(
                hidden,
                self.codec,
                step_id,
                rewind,
                next_hops=chain,
                micro_batch=self.micro_batch,
                reply_last=last,
            )
        except PEER_FAULTS:
            return 0, hidden  # the relay loop retries hop 0 and replaces it if it is gone
        return await self._collect(hops, step_id, hidden, sent, last)

    def _chain(self) -> list[HopSession]:
        """The remote hops a push from the first one reaches: up to the first hop that takes
        pushes from another peer than the hop before it."""
        hops = [hop for hop in self.route.hops if isinstance(hop, HopSession)]
        reach = next(
            (k for k in range(1, len(hops)) if hops[k].upstream != hops[k - 1].peer_id),
            len(hops),
        )
        return hops[:reach]

    def _chunks(self, hidden: torch.Tensor, route: Sequence[RouteHop]) -> list[torch.Tensor]:
        """`hidden` cut along its tokens into the chunks it goes through `route` in."""
        mode = self.route.swarm.pipeline_prompts if self.pipeline is None else self.pipeline
        count = pipeline_chunks(int(hidden.shape[1]), route, mode)
        return list(hidden.tensor_split(count, dim=1))

    async def _pipeline(
        self,
        hops: Sequence[HopSession],
        chunks: list[torch.Tensor],
        carried: int | None,
        first_position: int,
    ) -> tuple[int, torch.Tensor]:
        """Push a step through `hops` (the whole route) as `chunks`, each sent to the first hop
        while the hops after it compute the chunks before (the first chunk went with the route's
        OpenSession as step `carried`, if not None). Returns (len(hops), the step's output), or,
        if any hop fails or a push fails, (0, the step's input) with every hop past
        `first_position` forgotten and a failed hop replaced: the caller relays the whole step
        again from the first hop, starting every cache at `first_position`."""
        ids = [
            carried if c == 0 and carried is not None else next(self.route.step_ids)
            for c in range(len(chunks))
        ]
        last = self._reply_last(chunks)
        for c, chunk in enumerate(chunks):
            _expect_pushed(hops, ids[c], chunk, last, queued=c > 0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_chunks, hops, chunks, ids, carried is not None, last)
            outputs, failed = await self._collect_chunks(hops, chunks, ids)
            nursery.cancel_scope.cancel()
        if failed is None:  # with reply_last, the last chunk's reply holds the positions kept
            return len(hops), outputs[-1] if last is not None else torch.cat(outputs, dim=1)
        # Start over from the first hop, whole. Hops may hold any number of the chunks: the
        # step relayed next starts every cache at first_position, and pushed chunks still on
        # their way are stale there (their ids come before its).
        self.route.truncate(first_position)
        index, error = failed
        if error is not None:
            await self.route.replace(index, error)
        return 0, torch.cat(chunks, dim=1)

    async def _send_chunks(
        self,
        hops: Sequence[HopSession],
        chunks: list[torch.Tensor],
        ids: list[int],
        carried: bool,
        reply_last: int | None,
    ) -> None:
        """Send the chunks (but a `carried` first one) to the first hop, each queued behind the
        last, naming the rest of `hops` to push them through; stop at a broken stream (the
        reply to that chunk then fails to come, which _collect_chunks handles)."""
        chain = tuple(hop.as_next_hop() for hop in hops[1:])
        for c, chunk in enumerate(chunks):
            if c == 0 and carried:
                continue
            try:
                await hops[0].send_step(
                    chunk,
                    self.codec,
                    ids[c],
                    next_hops=chain,
                    micro_batch=self.micro_batch,
                    queued=c > 0,
                    reply_last=reply_last,
                )
            except PEER_FAULTS:
                return

    async def _collect_chunks(
        self, hops: Sequence[HopSession], chunks: list[torch.Tensor], ids: list[int]
    ) -> tuple[list[torch.Tensor], tuple[int, Exception | None] | None]:
        """Every hop's reply to every chunk, chunk by chunk, each hop's input remembered: (the
        last hop's outputs, None), or at the first failure (the outputs so far, (the index of
        the hop to start again from, the fault to replace it for; None: a push failed, the hop
        is fine))."""
        outputs: list[torch.Tensor] = []
        for c, chunk in enumerate(chunks):
            hidden = chunk
            for i, hop in enumerate(hops):
                try:
                    result = await hop.receive_result(ids[c])
                except PEER_FAULTS as e:
                    return outputs, (i, _pushed_fault(e) if i > 0 else e)
                self.route.remember(hop.hop.start, hidden)
                self.route.swarm.report_success(hop.peer_id)
                hidden = result.hidden_states.to(chunk.dtype)
                if result.push_failed and i + 1 < len(hops):
                    return outputs, (i + 1, None)
            outputs.append(hidden)
        return outputs, None

    async def _collect(
        self,
        hops: Sequence[HopSession],
        step_id: int,
        hidden: torch.Tensor,
        sent: float | None,
        reply_last: int | None = None,
    ) -> tuple[int, torch.Tensor]:
        """Every hop's reply to step `step_id`, sent to the first of `hops` (at `sent`; None:
        with its OpenSession, so not timed) and pushed through the rest: (first hop not done,
        its input; the output if all are done, its last `reply_last` positions only)."""
        _expect_pushed(hops, step_id, hidden, reply_last)
        for i, hop in enumerate(hops):
            try:
                result = await hop.receive_result(step_id)
            except PEER_FAULTS as e:
                await self.route.replace(i, _pushed_fault(e) if i > 0 else e)
                return i, hidden
            self.route.remember(hop.hop.start, hidden)
            self.route.swarm.report_success(hop.peer_id)
            if i == 0 and sent is not None:  # a later hop's input comes by push: not timed
                _record_step(self.route, hop.hop, hidden, sent)
            hidden = result.hidden_states.to(hidden.dtype)  # ours, whatever the server sent
            if result.push_failed and i + 1 < len(hops):
                return i + 1, hidden
        return len(hops), hidden


def _expect_pushed(
    hops: Sequence[HopSession],
    step_id: int,
    like: torch.Tensor,
    reply_last: int | None,
    queued: bool = False,
) -> None:
    """The hops after the first owe a reply to step `step_id`, pushed to them: on their own
    streams, shaped as its input `like`, the last one's cut to the step's `reply_last`."""
    for k, hop in enumerate(hops[1:], start=1):
        hop.expect(
            step_id, like, queued=queued, reply_last=reply_last if k == len(hops) - 1 else None
        )


def _pushed_fault(error: Exception) -> Exception:
    """A fault of a hop that got the step pushed by the server before it: one that input from
    that server could cause is Unattributed (a refusal of the step, a reply that breaks the
    conversation or is wrong, silence: the push may never have come); the stream's end or
    bytes that are no message are the hop's own."""
    if isinstance(error, LeaseLapsed):  # the server's own doing, and no fault
        return error
    if isinstance(error, Unattributed | StepRefused | Idle | wire.ConversationError):
        if isinstance(error, Unattributed):
            return error
        unattributed = Unattributed(f"{error} (on a step pushed to it)")
        unattributed.__cause__ = error
        return unattributed
    return error


def _record_step(route: RouteKeeper, hop: RouteHop, hidden: torch.Tensor, sent: float) -> None:
    """Tell the swarm view how long `hop`'s server took over a step of `hidden` sent at `sent`
    (routing believes announced throughputs only as far as such timings allow)."""
    tokens = int(hidden.shape[0]) * int(hidden.shape[1])
    route.swarm.record_step(hop.peer_id, hop.end - hop.start, tokens, time.perf_counter() - sent)
