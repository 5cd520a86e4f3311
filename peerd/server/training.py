"""The server's side of the training protocol: cache-less Forward and Backward passes through the
server's blocks, each answered in turn, run on the compute queue behind any inference step.

The server keeps nothing between a Forward and its Backward: the Backward recomputes the forward
with autograd on. A request that breaks the rules (wire.training_conversation.ServerTraining, or
this server's blocks and limits) gets an Error and the stream goes on.

Training shares the device fairly with inference: a pass runs as slices, each one block of the
span over a group of whole rows of at most SLICE_TOKENS tokens (attention needs a whole sequence,
so a row is never cut), and each slice is a job of its own on the compute queue, where inference
steps go first; so an inference step waits for at most one slice, whatever the training load. A
Backward runs the span's forward slice by slice without autograd, keeping each block's input,
then block by block from the last recomputes that block with autograd and carries the gradient
back (per-block checkpointing: one forward more than a plain backward). Each peer may have
`max_training_per_peer` requests queued or running, all peers together `max_training_inflight`
(admission.training_slot), and a request's tokens are capped so that its Backward finishes well
within a client's pass timeout at the speed this server measured on its own slices (TrainingPace).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import trio

import wire
from blocks import Span
from peerd.node.streams import Idle, MessageStream, PeerGone
from peerd.server.admission import Refused
from peerd.server.boundary import SESSION_IDLE_TIMEOUT_S, stream_boundary
from wire.training_conversation import ServerTraining

if TYPE_CHECKING:
    from peerd.server.block_server import BlockServer

R = TypeVar("R")

# Tokens (rows x tokens) of one slice, past which a pass's rows are split into groups. A row
# longer than this is one slice on its own: the request's token cap bounds it.
SLICE_TOKENS = 1024
# The time a Backward's slices may compute here: a fifth of a client's pass timeout
# (peerd.session.training's PASS_TIMEOUT_S, 120 s): while inference is active each slice rests
# up to compute.MAX_REST (4) times as long as it ran.
PASS_BUDGET_S = 24.0
# A Backward costs about this many forwards: one plain, one recomputed with autograd, and the
# backward itself (about two).
BACKWARD_COST = 4.0
# The token cap never goes below this, however slow the measured passes: a server too slow for
# this many tokens within the budget is too slow for training at all.
MIN_TRAINING_TOKENS = 256
GONE = "gone"  # what _answer returns when the peer closed the stream before its answer


class TrainingPace:
    """How fast this server runs training slices: token-blocks of forward per second, smoothed
    over the slices of at least MIN_TRAINING_TOKENS tokens run so far (smaller ones are mostly
    per-call overhead and would understate the speed of the big requests the cap is for)."""

    def __init__(self) -> None:
        self.rate = 0.0  # 0: nothing measured yet

    def observe(self, tokens: int, forwards: float, seconds: float) -> None:
        """A slice of `tokens` tokens through one block, worth `forwards` forward passes (a
        backward slice: BACKWARD_COST - 1), took `seconds`."""
        if seconds <= 0 or tokens < MIN_TRAINING_TOKENS:
            return
        rate = tokens * forwards / seconds
        self.rate = rate if not self.rate else 0.8 * self.rate + 0.2 * rate

    def max_tokens(self, num_blocks: int, limit: int) -> int:
        """Most tokens a request over `num_blocks` blocks may carry: its Backward must fit in
        PASS_BUDGET_S at the measured rate (`limit` alone until something was measured)."""
        if not self.rate:
            return limit
        fits = int(PASS_BUDGET_S * self.rate / (BACKWARD_COST * max(num_blocks, 1)))
        return max(MIN_TRAINING_TOKENS, min(limit, fits))


async def handle_training(server: BlockServer, messages: MessageStream) -> None:
    """Forward and Backward requests until the client closes the stream or goes quiet. A
    message that cannot be read (broken framing) ends the stream: it cannot be trusted; a
    request past this peer's quota is refused and the stream goes on, but its next message is
    read (and decoded: megabytes of tensors) only once the peer has room again, so a peer that
    sends again at once cannot keep the event loop decoding requests that are then refused."""
    conv = ServerTraining()
    pending: list[wire.Message] = []  # a message that came while a request ran (out of turn)
    async with stream_boundary(server, messages, "training"):
        while True:
            message = pending.pop() if pending else await messages.receive(SESSION_IDLE_TIMEOUT_S)
            refused = await _answer(server, messages, conv, message, pending)
            # No request's tensors are held from here on (_answer's frame is gone): the memory
            # they took goes back to the system (peerd.server.memory).
            del message
            last = server.admission.training_inflight == 0
            await server.compute.memory.after_work(last_work=last)
            if refused == GONE:
                return
            if refused == wire.ErrorCode.INFLIGHT_LIMIT:
                await server.admission.training_room(messages.remote_peer)


async def _answer(
    server: BlockServer,
    messages: MessageStream,
    conv: ServerTraining,
    message: wire.Message,
    pending: list[wire.Message],
) -> str | None:
    """Answer one request: its result, or an Error (then its code is returned); GONE when the
    peer left meanwhile (returned, not raised: a traceback would keep the request's tensors)."""
    try:
        request = conv.receive(message).request
        del message
        with server.admission.training_slot(messages.remote_peer):
            reply = await _run_while_connected(server, messages, request, pending)
        await messages.send(reply, request.reply_compression)
    except wire.ProtocolError as e:
        await server.refuse(messages, wire.ErrorCode.BAD_REQUEST, str(e))
        return wire.ErrorCode.BAD_REQUEST
    except Refused as e:
        await server.refuse(messages, e.code, str(e))
        return e.code
    except PeerGone:
        return GONE
    return None


async def _run_while_connected(
    server: BlockServer,
    messages: MessageStream,
    request: wire.Forward | wire.Backward,
    pending: list[wire.Message],
) -> wire.ForwardResult | wire.BackwardResult:
    """run_training(request), given up (PeerGone) when the peer closes the stream meanwhile:
    nobody would read the answer, and a flood would keep the device busy long after its
    sender left. A message the peer sends meanwhile is kept in `pending` for its turn."""
    _check(server, request)  # a refusal before the watcher starts reading
    gone: list[PeerGone] = []
    try:
        reply = await _run_watched(server, messages, request, pending, gone)
    except BaseExceptionGroup as group:  # the nursery's: the stream boundary wants the error
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
            raise group.exceptions[0] from None
        raise
    if gone:
        raise gone[0]
    assert reply is not None  # it ran to its end
    return reply


async def _run_watched(
    server: BlockServer,
    messages: MessageStream,
    request: wire.Forward | wire.Backward,
    pending: list[wire.Message],
    gone: list[PeerGone],
) -> wire.ForwardResult | wire.BackwardResult | None:
    """run_training(request) while a watcher reads the stream (see _run_while_connected); None
    when the watcher found the peer gone (in `gone`)."""
    reply = None
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            try:
                pending.append(await messages.receive(SESSION_IDLE_TIMEOUT_S))
            except Idle:
                return
            except PeerGone as e:
                gone.append(e)
                nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        reply = await run_training(server, request)
        nursery.cancel_scope.cancel()
    return reply


async def run_training(
    server: BlockServer, request: wire.Forward | wire.Backward
) -> wire.ForwardResult | wire.BackwardResult:
    """Check a Forward or Backward against the server's blocks and limits, then run it slice by
    slice on the compute queue behind any inference step. ProtocolError says what was wrong."""
    _check(server, request)
    batch, tokens, _ = request.hidden_states.shape
    server.counters.training_passes += 1
    server.counters.tokens_processed += batch * tokens
    pieces = [_blocks(server, request.start, request.end, rows) for rows in _row_groups(request)]
    if isinstance(request, wire.Forward):
        outputs = [
            await _forward(server, blocks, request.hidden_states[rows], _prompts(request, rows))
            for rows, blocks in pieces
        ]
        return wire.ForwardResult(hidden_states=torch.cat(outputs))
    grads, prompt_grads = [], []
    for rows, blocks in pieces:
        grad, grad_prompts = await _backward(
            server,
            blocks,
            request.hidden_states[rows],
            request.grad_outputs[rows],
            _prompts(request, rows),
        )
        grads.append(grad)
        prompt_grads.append(grad_prompts)
    return wire.BackwardResult(
        grad_inputs=torch.cat(grads), grad_prompts=_join_prompt_grads(request, prompt_grads)
    )


def _row_groups(request: wire.Forward | wire.Backward) -> list[slice]:
    """The request's rows in groups of at most SLICE_TOKENS tokens (at least one row each)."""
    batch, tokens, _ = request.hidden_states.shape
    rows = max(1, SLICE_TOKENS // max(tokens, 1))
    return [slice(first, min(first + rows, batch)) for first in range(0, batch, rows)]


def _blocks(server: BlockServer, start: int, end: int, rows: slice) -> tuple[slice, list[Span]]:
    return rows, [server.span_for(block, block + 1) for block in range(start, end)]


def _prompts(request: wire.Forward | wire.Backward, rows: slice) -> torch.Tensor | None:
    """The request's deep prompts for `rows` (a batch of 1 is shared by every row)."""
    prompts = request.prompts
    if prompts is None or prompts.shape[1] == 1:
        return prompts
    return prompts[:, rows]


def _join_prompt_grads(
    request: wire.Forward | wire.Backward, grads: list[torch.Tensor | None]
) -> torch.Tensor | None:
    """The prompts' gradient from each row group's: summed when the prompts are shared by every
    row, else the groups' rows side by side."""
    if request.prompts is None:
        return None
    present = [grad for grad in grads if grad is not None]
    if request.prompts.shape[1] == 1:
        return torch.stack(present).sum(dim=0)
    return torch.cat(present, dim=1)


def _per_block(
    blocks: list[Span], prompts: torch.Tensor | None
) -> list[tuple[Span, torch.Tensor | None]]:
    """Each block with its deep prompts (a [1, batch or 1, prefix, hidden] slice), in order."""
    if prompts is None:
        return [(block, None) for block in blocks]
    return [(block, prompts[index : index + 1]) for index, block in enumerate(blocks)]


async def _forward(
    server: BlockServer, blocks: list[Span], hidden: torch.Tensor, prompts: torch.Tensor | None
) -> torch.Tensor:
    """The span's forward over `hidden`, one block per compute job."""
    for block, block_prompts in _per_block(blocks, prompts):
        hidden = await _slice(server, 1.0, hidden, training_forward, block, hidden, block_prompts)
    return hidden


async def _backward(
    server: BlockServer,
    blocks: list[Span],
    hidden: torch.Tensor,
    grad_outputs: torch.Tensor,
    prompts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the span's inputs (and prompts) from its outputs', one block per job."""
    per_block = _per_block(blocks, prompts)
    inputs = []
    for block, block_prompts in per_block:
        inputs.append(hidden)
        hidden = await _slice(server, 1.0, hidden, training_forward, block, hidden, block_prompts)
    grad = grad_outputs
    prompt_grads: list[torch.Tensor] = []
    for (block, block_prompts), block_input in reversed(list(zip(per_block, inputs, strict=True))):
        grad, grad_prompts = await _slice(
            server,
            BACKWARD_COST - 1,
            block_input,
            training_backward,
            block,
            block_input,
            grad,
            block_prompts,
        )
        if grad_prompts is not None:
            prompt_grads.insert(0, grad_prompts)
    return grad, torch.cat(prompt_grads) if prompt_grads else None


async def _slice(
    server: BlockServer, cost: float, hidden: torch.Tensor, fn: Callable[..., R], *args: object
) -> R:
    """fn(*args) as one job on the compute queue behind any inference step; its speed (`cost`
    forwards of `hidden`'s tokens through one block) goes into the server's TrainingPace."""

    def timed() -> tuple[R, float]:
        started = time.perf_counter()
        result = fn(*args)
        return result, time.perf_counter() - started

    result, seconds = await server.compute.training_slice(timed)
    server.counters.training_slices += 1
    server.training_pace.observe(hidden.shape[0] * hidden.shape[1], cost, seconds)
    return result


def _check(server: BlockServer, request: wire.Forward | wire.Backward) -> None:
    if request.model != server.model:
        raise wire.ProtocolError(
            f"this server serves model {server.model!r}, not {request.model!r}"
        )
    if server.span is None or not (server.start <= request.start < request.end <= server.end):
        raise wire.ProtocolError(
            f"this server holds blocks {server.start}:{server.end} of {server.model} "
            f"({server.state.value}); it cannot run blocks {request.start}:{request.end}"
        )
    batch, tokens, width = request.hidden_states.shape
    if width != server.hidden_size:
        raise wire.ProtocolError(f"hidden_states must be {server.hidden_size} wide, got {width}")
    limit = server.training_pace.max_tokens(
        request.end - request.start, server.limits.max_training_tokens
    )
    if batch * tokens > limit:
        raise wire.ProtocolError(
            f"{batch} x {tokens} tokens exceed this server's limit of {limit} per training "
            f"request over {request.end - request.start} blocks (its backward must finish in "
            f"{PASS_BUDGET_S:.0f} s at this server's measured speed): send smaller micro-batches"
        )


def training_forward(
    span: Span, hidden: torch.Tensor, prompts: torch.Tensor | None
) -> torch.Tensor:
    with torch.no_grad():
        return span(hidden, prompts=prompts)


def training_backward(
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
