"""The swarm's side of the transformers model: its connection to the local daemon, an inference
session that transformers sees as the KV cache (RemoteSession), and every block as one
differentiable function for training passes (RemoteBlocks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache

import wire
from peerd.sdk.client import Client, PeerdError
from peerd.sdk.model_checks import NO_BEAMS, NO_REWIND, UnsupportedGeneration

# Errors after which the connection's byte stream can no longer be trusted.
OUT_OF_STEP = (wire.ErrorCode.CONNECTION_CLOSED, wire.ErrorCode.BAD_REPLY)


class DaemonConnection:
    """The model's connection to the local daemon. A request cut off half-way (Ctrl-C, a timeout,
    a broken reply) leaves the connection out of step, its reply still unread: it is then dropped,
    which frees its sessions on the daemon, and opened afresh on next use."""

    def __init__(self, path: str | Path | None, timeout: float, **routing: Any) -> None:
        """`routing`: Client's show_route and routing controls, for every session it opens."""
        self._client: Client | None = Client(path, timeout=timeout, **routing)
        self.path = self._client.path
        self.timeout = timeout
        self.routing = routing

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.path, timeout=self.timeout, **self.routing)
        return self._client

    @contextlib.contextmanager
    def request(self) -> Iterator[Client]:
        """The client, for one request and its reply."""
        try:
            yield self.client
        except PeerdError as e:
            if e.code in OUT_OF_STEP:
                self.close()
            raise
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class RemoteSession(Cache):
    """An inference session through the swarm (via the local daemon), which transformers sees as
    the model's KV cache. It holds no keys or values, only what the servers hold: `position`
    tokens, and `output_ids`, the token ids of the sequence so far when known (it may end with one
    token sampled but not yet fed, as `generate` leaves it). Use as a context manager."""

    def __init__(
        self,
        daemon: DaemonConnection,
        *,
        max_length: int,
        batch_size: int = 1,
        adapter: str | None = None,
        left_padding: tuple[int, ...] = (),
    ) -> None:
        super().__init__(layers=[])
        self.daemon = daemon
        self.adapter = adapter  # the LoRA adapter every server of the session applies
        self.max_length = max_length
        self._batch_size = batch_size
        # Per row, padding positions at the start (prompts left-padded to one length).
        self.left_padding = tuple(left_padding)
        self.session_id: str | None = None
        self.position = 0
        self.output_ids: torch.Tensor | None = None

    def __enter__(self) -> RemoteSession:
        with self.daemon.request() as client:
            self.session_id = client.open_session(
                self.max_length, self._batch_size, self.adapter, self.left_padding
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        session_id, self.session_id = self.session_id, None
        if session_id is not None:
            # A dropped connection took its sessions with it: then there is nothing to close.
            with contextlib.suppress(PeerdError, OSError), self.daemon.request() as client:
                client.close_session(session_id)

    def __repr__(self) -> str:
        return (
            f"RemoteSession(session_id={self.session_id!r}, position={self.position}, "
            f"max_length={self.max_length}, batch_size={self.batch_size})"
        )

    def step(self, hidden: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """Hidden states after the embeddings -> after the last block, extending the servers'
        caches. `input_ids` (None when the caller fed embeddings) keeps `output_ids` current."""
        if self.session_id is None:
            raise RuntimeError("this inference session is closed; open a new one")
        start, tokens = self.position, hidden.shape[1]
        if hidden.shape[0] != self.batch_size:
            raise ValueError(
                f"this inference session was opened for batch size {self.batch_size}, "
                f"got {hidden.shape[0]} sequences"
            )
        if start + tokens > self.max_length:
            raise ValueError(
                f"the session holds {start} of its max_length {self.max_length} tokens and "
                f"cannot take {tokens} more: open a longer inference_session"
            )
        try:
            with self.daemon.request() as client:
                output = client.step(self.session_id, hidden)
        except BaseException as e:
            if not isinstance(e, PeerdError) or e.code in OUT_OF_STEP:
                self.session_id = None  # cut off mid-step: what the servers hold is unknown
            raise
        self.position += tokens
        known = self.output_ids
        if input_ids is None:
            self.output_ids = None
        elif start == 0:
            self.output_ids = input_ids
        elif known is not None and known.shape[1] >= start:
            self.output_ids = torch.cat([known[:, :start], input_ids.to(known.device)], dim=1)
        else:
            self.output_ids = None
        return output

    # --- what transformers asks of a cache ---------------------------------------------------

    def __bool__(self) -> bool:
        return True  # Cache's len() counts local layers: none here, yet the session is there

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_length

    @property
    def is_linear(self) -> list[bool]:
        return [False]  # attention caches: generate slices inputs past what they hold

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a RemoteSession holds no keys or values: they stay on the servers")

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedGeneration(NO_REWIND)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedGeneration(NO_BEAMS)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedGeneration(NO_BEAMS)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedGeneration(NO_BEAMS)


class RemoteBlocks(torch.autograd.Function):
    """Every decoder block as one differentiable function, computed by the swarm: forward is a
    TrainingForward through the local daemon (which keeps each hop's input), backward the
    matching TrainingBackward (each server recomputes its span and returns input gradients)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, prompts: torch.Tensor | None, daemon: DaemonConnection
    ) -> torch.Tensor:
        with daemon.request() as client:
            output = client.training_forward(
                hidden.detach(), None if prompts is None else prompts.detach(), keep=True
            )
        ctx.daemon = daemon
        ctx.forward_id = output.forward_id
        return output.hidden_states

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        with ctx.daemon.request() as client:
            grads = client.training_backward(ctx.forward_id, grad_output.contiguous())
        return grads.grad_inputs, grads.grad_prompts, None


def remote_blocks(
    daemon: DaemonConnection, hidden: torch.Tensor, prompts: torch.Tensor | None
) -> torch.Tensor:
    """Hidden states after the embeddings -> after the last block, cache-less, on a training
    route; differentiable in `hidden` and the deep `prompts` when autograd needs them."""
    wants_grad = hidden.requires_grad or (prompts is not None and prompts.requires_grad)
    if torch.is_grad_enabled() and wants_grad:
        output: torch.Tensor = RemoteBlocks.apply(hidden, prompts, daemon)
        return output
    with daemon.request() as client:
        detached = None if prompts is None else prompts.detach()
        return client.training_forward(hidden.detach(), detached, keep=False).hidden_states


def remote_cache(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    cache: Cache | None,
    output_attentions: bool | None,
    kwargs: dict[str, Any],
) -> RemoteSession | None:
    """forward's cache, checked: a RemoteSession or None (ValueError / TypeError otherwise)."""
    if output_attentions:
        raise ValueError("attention weights stay on the servers: no output_attentions")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # its name before transformers 5
    if cache is not None and not isinstance(cache, RemoteSession):
        raise TypeError(
            f"the KV cache lives on the servers: pass a RemoteSession from "
            f"model.inference_session(), not a {type(cache).__name__}"
        )
    return cache


def check_positions(
    cache: RemoteSession | None,
    padding: tuple[int, ...],
    position_ids: torch.Tensor | None,
    tokens: int,
) -> None:
    """Refuse a mask or positions that do not follow what the session holds (ValueError)."""
    past = cache.position if cache is not None else 0
    if cache is not None and any(padding) and padding != cache.left_padding:
        raise ValueError(
            f"attention_mask pads the rows by {list(padding)}, the session was opened with "
            f"left_padding {list(cache.left_padding)}: open it with the mask's padding "
            "(generate does, from attention_mask)"
        )
    if position_ids is None:
        return
    # The last token of each row, counted without the row's padding.
    held = cache.left_padding if cache is not None else padding
    pads = torch.tensor(held) if held else torch.tensor(0)
    expected = past + tokens - 1 - pads
    if bool((position_ids[..., -1].cpu() != expected).any()):
        raise ValueError(
            f"these tokens end at positions {position_ids[..., -1].tolist()}, but the "
            f"servers hold {past}: give only the tokens the session has not seen"
        )
