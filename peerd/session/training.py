"""Client side of distributed training: cache-less forward and backward passes through a route.

The daemon runs these for its local clients (TrainingForward / TrainingBackward on the local API,
which `peerd.sdk.model` wraps in a `torch.autograd.Function`). A forward pass goes hop by hop on a
training route and keeps each hop's input; the backward pass goes back through the same hops,
each server recomputing its span's forward with autograd and returning the gradient of its input
(and of its deep prompts). Servers keep nothing between the two and their weights never change.

When a hop fails, in either pass, its server is banned, a replacement route for its blocks is
planned, and the replacement runs that span's forward again from the kept input before the pass
goes on: the gradients are those of the same function, so the caller sees no difference.

A pass goes to each hop in micro-batches of whole rows of at most CHUNK_TOKENS tokens, or of the
cap a server stated when it refused a bigger request (a slow server takes fewer tokens, so that
its backward finishes within PASS_TIMEOUT_S): that hop is sent again split to its cap.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import trio

import wire
from peerd.node.p2p import TRAINING_PROTOCOL
from peerd.node.streams import PeerGone
from peerd.session.hops import OPEN_TIMEOUT_S, PEER_FAULTS, dial
from peerd.session.route import MAX_HOP_FAILURES, ROUTE_WAIT_S, InferenceFailed
from peerd.session.swarm import SwarmView
from routing.planner import NoRouteError, RouteHop, format_route, route_hops
from wire.conversation import Refused
from wire.training_conversation import ClientTraining

log = logging.getLogger(__name__)

R = TypeVar("R", wire.ForwardResult, wire.BackwardResult)
T = TypeVar("T")

# A training pass recomputes a span's forward and runs its backward: a few times an inference
# step's work, on a queue where inference goes first.
PASS_TIMEOUT_S = 120.0
# A request's tensors (hidden states, their gradient, prompts) stay under this many bytes, and
# its tokens under the servers' default max_training_tokens: bigger batches go as micro-batches
# along the batch dimension, which is exact (sequences do not interact without a cache).
CHUNK_BYTES = 64 << 20
CHUNK_TOKENS = 4096
# Passes one local connection may keep for a backward; the oldest goes first beyond this.
MAX_KEPT_PASSES = 64
# A server refuses a request past its token cap (peerd.server.training: it follows the server's
# measured speed, so a slow server's cap may be below CHUNK_TOKENS) saying the cap in these words;
# the hop is then sent again in micro-batches of that many tokens, at most this many times.
SERVER_CAP = re.compile(r"limit of (\d+) per training request")
MAX_CAP_RETRIES = 3


class HopFailed(Exception):
    """One hop of a training pass failed; `refused` when a live server answered with an Error
    (it stays usable for others), else the server is gone or broken."""

    def __init__(self, peer_id: str, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.peer_id = peer_id
        self.refused = refused


@dataclass
class KeptHop:
    """One hop of a forward pass and the input it took: what its backward needs."""

    hop: RouteHop
    inputs: torch.Tensor


@dataclass
class KeptPass:
    hops: list[KeptHop]
    prompts: torch.Tensor | None


def micro_batches(
    batch: int, tokens: int, width: int, max_tokens: int = CHUNK_TOKENS
) -> list[slice]:
    """Row slices of a [batch, tokens, width] fp32 pass that each fit one request of at most
    `max_tokens` tokens (a row is never split: one row alone may have more)."""
    per_row = max(1, tokens * width * 4 * 3)
    rows = max(1, min(CHUNK_BYTES // per_row, max_tokens // max(1, tokens)))
    return [slice(i, min(i + rows, batch)) for i in range(0, batch, rows)]


class Trainer:
    """Training passes of one local connection through `swarm`, with the passes kept for
    backward (at most MAX_KEPT_PASSES)."""

    def __init__(self, swarm: SwarmView, codec: wire.peer_protocol.CompressionName = "raw"):
        self.swarm = swarm
        self.codec = codec  # raw fp32 by default: gradients must be exact
        self.kept: OrderedDict[str, KeptPass] = OrderedDict()
        self.failures = 0
        # Live servers that refused a request of this pass (skipped, not banned) and why.
        self.refused: dict[str, str] = {}
        # Tokens per request that servers said they take, below CHUNK_TOKENS (peer id -> cap).
        self.caps: dict[str, int] = {}

    # --- the two passes -----------------------------------------------------------------------

    async def forward(
        self, hidden: torch.Tensor, prompts: torch.Tensor | None, keep: bool
    ) -> tuple[torch.Tensor, str | None, tuple[str, ...]]:
        """Output of every block, the id of the kept pass (None unless `keep`), and the route."""
        self._check(hidden, prompts)
        self.failures, self.refused = 0, {}
        hops = await self._plan(0, self.swarm.num_blocks)
        kept: list[KeptHop] = []
        i = 0
        while i < len(hops):
            hop = hops[i]
            try:
                output = await self._forward_hop(hop, hidden, prompts)
            except HopFailed as e:
                hops[i : i + 1] = await self._replace(hop, e)
                continue  # the replacement starts at the same block: retry with `hidden`
            kept.append(KeptHop(hop, hidden))
            hidden = output
            i += 1
        forward_id = None
        if keep:
            forward_id = uuid.uuid4().hex
            self.kept[forward_id] = KeptPass(kept, prompts)
            while len(self.kept) > MAX_KEPT_PASSES:
                dropped, _ = self.kept.popitem(last=False)
                log.info("dropped kept training pass %s: over %d kept", dropped, MAX_KEPT_PASSES)
        return hidden, forward_id, route_hops([k.hop for k in kept])

    async def backward(
        self, forward_id: str, grad_outputs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[str, ...]]:
        """Gradients of the kept pass's input and prompts; the pass is released."""
        kept = self.kept.pop(forward_id, None)
        if kept is None:
            raise KeyError(
                f"no kept training pass {forward_id!r} on this connection (already used by a "
                f"backward, or dropped after {MAX_KEPT_PASSES} newer ones): run the forward again"
            )
        shape = tuple(kept.hops[-1].inputs.shape) if kept.hops else ()
        if tuple(grad_outputs.shape) != shape:
            raise ValueError(
                f"grad_outputs must have the forward's output shape {list(shape)}, got "
                f"{list(grad_outputs.shape)}"
            )
        self.failures, self.refused = 0, {}
        prompts = kept.prompts
        grad_prompts: dict[int, torch.Tensor] = {}
        used: list[RouteHop] = []
        grad = grad_outputs
        pending = list(kept.hops)
        while pending:
            last = pending.pop()
            try:
                grad_in, grad_p = await self._backward_hop(last.hop, last.inputs, grad, prompts)
            except HopFailed as e:
                # Re-run the span's forward on its replacement (which may split the blocks
                # differently), keeping the inputs at the new boundaries, then go on backward.
                pending.extend(await self._rerun(last, e, prompts))
                continue
            used.append(last.hop)
            if grad_p is not None:
                grad_prompts[last.hop.start] = grad_p
            grad = grad_in
        all_prompts = None
        if prompts is not None:
            all_prompts = torch.cat([grad_prompts[b] for b in sorted(grad_prompts)], dim=0)
        return grad, all_prompts, route_hops(used[::-1])

    def _check(self, hidden: torch.Tensor, prompts: torch.Tensor | None) -> None:
        wire.peer_protocol.check_prompts(prompts, hidden, self.swarm.num_blocks)

    async def _rerun(
        self, failed: KeptHop, error: HopFailed, prompts: torch.Tensor | None
    ) -> list[KeptHop]:
        while True:
            replacement = await self._replace(failed.hop, error)
            rerun: list[KeptHop] = []
            hidden = failed.inputs
            try:
                for hop in replacement:
                    rerun.append(KeptHop(hop, hidden))
                    hidden = await self._forward_hop(hop, hidden, prompts)
            except HopFailed as e:
                error = e  # a replacement died too: plan around it as well
                continue
            log.info(
                "re-ran blocks %d:%d on %s for the backward",
                failed.hop.start,
                failed.hop.end,
                format_route(tuple(replacement)),
            )
            return rerun

    # --- one hop ------------------------------------------------------------------------------

    async def _forward_hop(
        self, hop: RouteHop, hidden: torch.Tensor, prompts: torch.Tensor | None
    ) -> torch.Tensor:
        return await self._within_cap(
            hop, hidden.shape[1], lambda: self._forward_hop_once(hop, hidden, prompts)
        )

    async def _backward_hop(
        self,
        hop: RouteHop,
        hidden: torch.Tensor,
        grad_outputs: torch.Tensor,
        prompts: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return await self._within_cap(
            hop,
            hidden.shape[1],
            lambda: self._backward_hop_once(hop, hidden, grad_outputs, prompts),
        )

    async def _within_cap(
        self, hop: RouteHop, row_tokens: int, send: Callable[[], Awaitable[T]]
    ) -> T:
        """send(), sent again in smaller micro-batches (up to MAX_CAP_RETRIES times) while the
        hop's server refuses it for its token cap (_learn_cap)."""
        for retry in range(MAX_CAP_RETRIES + 1):
            try:
                return await send()
            except HopFailed as e:
                if retry == MAX_CAP_RETRIES or not self._learn_cap(hop, e, row_tokens):
                    raise
        raise AssertionError("unreachable")

    def _cap(self, hop: RouteHop) -> int:
        return self.caps.get(hop.peer_id, CHUNK_TOKENS)

    def _learn_cap(self, hop: RouteHop, error: HopFailed, row_tokens: int) -> bool:
        """Whether `error` was the hop's server refusing a request past its token cap, one that
        smaller micro-batches fit (a cap below our current one and not below one row): then
        that cap is kept for the server and the hop is to be sent again."""
        found = SERVER_CAP.search(str(error)) if error.refused else None
        if found is None:
            return False
        cap = int(found.group(1))
        if not row_tokens <= cap < self._cap(hop):
            return False
        log.info("server %s takes %d tokens per training request: splitting", hop.peer_id, cap)
        self.caps[hop.peer_id] = cap
        return True

    async def _forward_hop_once(
        self, hop: RouteHop, hidden: torch.Tensor, prompts: torch.Tensor | None
    ) -> torch.Tensor:
        outputs = []
        for rows in micro_batches(*_rows_tokens_width(hidden), self._cap(hop)):
            request = wire.Forward(
                model=self.swarm.model,
                start=hop.start,
                end=hop.end,
                hidden_states=hidden[rows],
                prompts=_prompts_for(prompts, hop, rows),
                reply_compression=self.codec,
            )
            reply = await self._call(hop, request, wire.ForwardResult)
            outputs.append(reply.hidden_states)
        self.swarm.report_success(hop.peer_id)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    async def _backward_hop_once(
        self,
        hop: RouteHop,
        hidden: torch.Tensor,
        grad_outputs: torch.Tensor,
        prompts: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        grad_inputs: list[torch.Tensor] = []
        grad_prompts: list[torch.Tensor] = []
        for rows in micro_batches(*_rows_tokens_width(hidden), self._cap(hop)):
            request = wire.Backward(
                model=self.swarm.model,
                start=hop.start,
                end=hop.end,
                hidden_states=hidden[rows],
                grad_outputs=grad_outputs[rows],
                prompts=_prompts_for(prompts, hop, rows),
                reply_compression=self.codec,
            )
            reply = await self._call(hop, request, wire.BackwardResult)
            grad_inputs.append(reply.grad_inputs)
            if prompts is not None:
                if reply.grad_prompts is None:
                    raise HopFailed(hop.peer_id, f"{hop.peer_id} sent no gradient of the prompts")
                grad_prompts.append(reply.grad_prompts)
        self.swarm.report_success(hop.peer_id)
        grad_p = None
        if prompts is not None:
            # Prompts shared by every row (batch 1) collect the gradient of every micro-batch.
            shared = prompts.shape[1] == 1
            grad_p = torch.stack(grad_prompts).sum(0) if shared else torch.cat(grad_prompts, dim=1)
        return torch.cat(grad_inputs, dim=0), grad_p

    async def _call(
        self, hop: RouteHop, request: wire.Forward | wire.Backward, reply_type: type[R]
    ) -> R:
        """One request to one hop: our own server directly, any other over a training stream."""
        local = self.swarm.local_server
        reply: wire.Message
        if local is not None and hop.peer_id == local.peer_id:
            try:
                reply = await local.run_training(request)
            except (wire.ProtocolError, ValueError) as e:
                raise HopFailed(hop.peer_id, f"our own server refused: {e}", refused=True) from e
            assert isinstance(reply, reply_type)
            return reply
        try:  # unreachable, dial refused, protocol not offered
            stream = await dial(self.swarm, hop, TRAINING_PROTOCOL, OPEN_TIMEOUT_S)
        except PeerGone as e:
            raise HopFailed(hop.peer_id, str(e)) from e
        conversation = ClientTraining()
        conversation.sent(request)
        try:
            await stream.send(request, self.codec)
            # A reply of the wrong kind is the conversation's UnexpectedReply: a peer fault.
            event = conversation.received(await stream.receive(PASS_TIMEOUT_S))
        except PEER_FAULTS as e:
            raise HopFailed(hop.peer_id, f"{hop.peer_id} failed: {e}") from e
        finally:
            await stream.close()
        if isinstance(event, Refused):
            raise HopFailed(
                hop.peer_id, f"{hop.peer_id} refused: {event.error.message}", refused=True
            )
        assert isinstance(event.result, reply_type)  # the conversation checked its kind
        return event.result

    # --- routes -------------------------------------------------------------------------------

    async def _replace(self, hop: RouteHop, error: HopFailed) -> list[RouteHop]:
        """Hops for the failed hop's blocks on other servers."""
        self.failures += 1
        log.warning(
            "server %s failed on blocks %d:%d during training (%s); re-routing",
            hop.peer_id,
            hop.start,
            hop.end,
            error,
        )
        if error.refused:
            self.refused[hop.peer_id] = str(error)
        else:
            self.swarm.report_failure(hop.peer_id)
        if self.failures > MAX_HOP_FAILURES:
            raise InferenceFailed(
                f"{self.failures} servers failed during this training pass; giving up: {error}"
            )
        started = time.perf_counter()
        hops = await self._plan(hop.start, hop.end)
        log.info(
            "blocks %d:%d moved from %s to %s in %.2f s",
            hop.start,
            hop.end,
            hop.peer_id,
            format_route(tuple(hops)),
            time.perf_counter() - started,
        )
        return hops

    async def _plan(self, start: int, end: int) -> list[RouteHop]:
        """A training route over [start, end), waiting a while for servers to (re)appear."""
        deadline = trio.current_time() + ROUTE_WAIT_S
        while True:
            try:
                route = self.swarm.plan(start, end, mode="training", blocked_servers=self.refused)
                return list(route)
            except NoRouteError as e:
                if self.refused:  # every server left refused: the request itself is the problem
                    raise InferenceFailed("; ".join(self.refused.values())) from e
                if trio.current_time() > deadline:
                    raise InferenceFailed(str(e)) from e
                await self.swarm.refresh()
                await trio.sleep(0.5)


def _rows_tokens_width(hidden: torch.Tensor) -> tuple[int, int, int]:
    batch, tokens, width = hidden.shape
    return batch, tokens, width


def _prompts_for(prompts: torch.Tensor | None, hop: RouteHop, rows: slice) -> torch.Tensor | None:
    """The hop's blocks' deep prompts for the rows of one micro-batch."""
    if prompts is None:
        return None
    mine = prompts[hop.start : hop.end]
    return mine if mine.shape[1] == 1 else mine[:, rows]
