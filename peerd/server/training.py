"""The server's side of the training protocol: cache-less Forward and Backward passes through the
server's blocks, each answered in turn, run on the compute queue behind any inference step.

The server keeps nothing between a Forward and its Backward: the Backward recomputes the forward
with autograd on. A request that breaks the rules (wire.conversation.ServerTraining, or this
server's blocks and limits) gets an Error and the stream goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import wire
from blocks import Span
from peerd.node.streams import MessageStream
from peerd.server.boundary import SESSION_IDLE_TIMEOUT_S, stream_boundary
from peerd.server.compute import PRIORITY_TRAINING
from wire.conversation import ServerTraining

if TYPE_CHECKING:
    from peerd.server.block_server import BlockServer


async def handle_training(server: BlockServer, messages: MessageStream) -> None:
    """Forward and Backward requests until the client closes the stream or goes quiet. A
    message that cannot be read (broken framing) ends the stream: it cannot be trusted."""
    conv = ServerTraining()
    async with stream_boundary(server, messages, "training"):
        while True:
            message = await messages.receive(SESSION_IDLE_TIMEOUT_S)
            try:
                request = conv.receive(message).request
                reply = await run_training(server, request)
            except wire.ProtocolError as e:
                await server.refuse(messages, wire.ErrorCode.BAD_REQUEST, str(e))
                continue
            await messages.send(reply, request.reply_compression)


async def run_training(
    server: BlockServer, request: wire.Forward | wire.Backward
) -> wire.ForwardResult | wire.BackwardResult:
    """Check a Forward or Backward against the server's blocks and limits, then run it on the
    compute queue behind any inference step. ProtocolError says what was wrong."""
    _check(server, request)
    batch, tokens, _ = request.hidden_states.shape
    span = server.span_for(request.start, request.end)
    server.counters.training_passes += 1
    server.counters.tokens_processed += batch * tokens
    if isinstance(request, wire.Forward):
        output = await server.compute.run(
            PRIORITY_TRAINING, training_forward, span, request.hidden_states, request.prompts
        )
        return wire.ForwardResult(hidden_states=output)
    grad_inputs, grad_prompts = await server.compute.run(
        PRIORITY_TRAINING,
        training_backward,
        span,
        request.hidden_states,
        request.grad_outputs,
        request.prompts,
    )
    return wire.BackwardResult(grad_inputs=grad_inputs, grad_prompts=grad_prompts)


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
    if batch * tokens > server.limits.max_training_tokens:
        raise wire.ProtocolError(
            f"{batch} x {tokens} tokens exceed this server's limit of "
            f"{server.limits.max_training_tokens} per training request: send smaller "
            "micro-batches"
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
