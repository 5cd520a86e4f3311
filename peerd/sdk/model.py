"""The transformers-compatible model: a `PreTrainedModel` whose decoder blocks run on the swarm.

    from peerd.model import AutoDistributedModelForCausalLM
    model = AutoDistributedModelForCausalLM.from_pretrained("default")  # the local daemon's model
    ids = model.tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    print(model.tokenizer.decode(model.generate(ids, max_new_tokens=32)[0]))

Only the embeddings, the final norm and the LM head live in this process (blocks.ClientSide);
hidden states go through every block via the local daemon's socket (peerd.sdk.client.Client), and
the
servers keep the KV caches. transformers' own GenerationMixin drives generation: the cache it
threads through `forward` is a `RemoteSession`, which holds no keys or values, only how many
tokens the servers hold, so `generate` feeds each token once. Greedy decoding and sampling work;
beam search and assisted decoding would need the servers to reorder or crop their caches, which
the local API does not offer, so they raise `UnsupportedGeneration`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

import blocks
from peerd.sdk.client import DEFAULT_TIMEOUT_S, Client, PeerdError

# The decoding loops whose cache only ever grows by appending tokens: the only kind a remote
# session can follow.
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
_NO_REWIND = (
    "it needs the servers to roll their KV caches back, which the local API does not offer: "
    "use greedy decoding (do_sample=False) or sampling (do_sample=True)"
)
_NO_BEAMS = (
    "beam search needs the servers to reorder their KV caches between steps, which the local "
    "API does not offer: use greedy decoding (do_sample=False) or sampling (do_sample=True)"
)

_NO_TUNED_SESSIONS = (
    "a prompt-tuned model runs cache-less passes only: inference sessions (and so generate) do "
    "not carry trained prompts yet; evaluate with model(input_ids).logits"
)

_NO_TRAINING_ADAPTER = (
    "training passes (prompt tuning, gradients of inputs_embeds) run the servers' base blocks: "
    "they cannot apply a LoRA adapter yet; load the model without active_adapter to tune it"
)

# Errors after which the connection's byte stream can no longer be trusted.
OUT_OF_STEP = ("connection_closed", "bad_reply")


class ModelMismatch(ValueError):
    """The daemon runs another model than the checkpoint this process loaded."""


class UnsupportedGeneration(NotImplementedError):
    """A generation mode that needs more of the servers' caches than appending tokens."""


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
        raise UnsupportedGeneration(_NO_REWIND)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedGeneration(_NO_BEAMS)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedGeneration(_NO_BEAMS)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedGeneration(_NO_BEAMS)


TuningMode = Literal["ptune", "deep_ptune"]
TUNING_MODES = ("ptune", "deep_ptune")


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


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose decoder blocks are served by the swarm. Build it with `from_pretrained`.

    `model(input_ids)` runs the sequence through the swarm in a session of its own (opened, stepped
    once, closed); pass `cache=session` (from `inference_session`) to continue that session.
    With `output_hidden_states=True`, `hidden_states` has two entries, not one per layer: the
    embeddings' output (`hidden_states[0]`, as in transformers) and the last hidden state after
    the final norm (`hidden_states[-1]`, as in transformers); the blocks' intermediate outputs
    stay on the servers. Attention weights are not available.

    Prompt tuning (`tuning_mode="ptune"` or `"deep_ptune"`, `pre_seq_len=N`): the model holds
    trainable `prompt_embeddings` [N, hidden], prepended to every input, and with deep_ptune also
    `intermediate_prompt_embeddings` [blocks, N, hidden] (zeros at first), block i's added to the
    first N positions of its input on the server that runs it. Forward passes then go through the
    swarm without a cache, `loss.backward()` reaches the prompts through the servers, and the
    outputs (logits, hidden states, loss) cover the given tokens only, not the N prefix positions.
    Only these prompts are trainable: every other weight is frozen (docs/finetuning.md).
    """

    main_input_name = "input_ids"
    # Attention runs on the servers: whatever implementation the config names is fine here.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(
        self,
        config: PretrainedConfig,
        client_side: blocks.ClientSide,
        daemon: DaemonConnection,
        generation_config: GenerationConfig | None = None,
        active_adapter: str | None = None,
        tuning_mode: TuningMode | None = None,
        pre_seq_len: int = 0,
    ) -> None:
        super().__init__(config)
        self.client_side = client_side
        self.daemon = daemon
        # The LoRA adapter sessions opened from now on run with (None: the base model); set it
        # to switch, as with peft's set_adapter. Servers without it are not routed through.
        self.active_adapter = active_adapter
        self.active_session: RemoteSession | None = None
        if generation_config is not None:
            self.generation_config = generation_config
        self.tuning_mode = tuning_mode
        self.pre_seq_len = _check_tuning(tuning_mode, pre_seq_len, active_adapter)
        self.prompt_embeddings: nn.Parameter | None = None
        self.intermediate_prompt_embeddings: nn.Parameter | None = None
        if tuning_mode is not None:
            weight = client_side.embeddings.weight
            hidden, blocks_count = int(config.hidden_size), int(config.num_hidden_layers)
            std = float(getattr(config, "initializer_range", 0.02))
            self.prompt_embeddings = nn.Parameter(
                torch.randn(pre_seq_len, hidden, dtype=weight.dtype, device=weight.device) * std
            )
            if tuning_mode == "deep_ptune":
                self.intermediate_prompt_embeddings = nn.Parameter(
                    weight.new_zeros(blocks_count, pre_seq_len, hidden)
                )
        self.post_init()

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        model: str | Path = "default",
        socket: str | Path | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        timeout: float = DEFAULT_TIMEOUT_S,
        active_adapter: str | None = None,
        allowed_servers: Sequence[str] | None = None,
        blocked_servers: Sequence[str] = (),
        max_retries: int | None = None,
        connect_timeout: float | None = None,
        request_timeout: float | None = None,
        show_route: bool = False,
        tuning_mode: TuningMode | None = None,
        pre_seq_len: int = 0,
    ) -> DistributedModelForCausalLM:
        """The model served by the daemon on `socket` (default: $PEERD_SOCKET, else the per-user
        socket), with embeddings, final norm and LM head loaded from the local checkpoint
        `model` ("default" or a directory): never its blocks. With `active_adapter`, every
        session runs with that LoRA adapter, only through servers that have it. `tuning_mode`
        ("ptune" or "deep_ptune") with `pre_seq_len` adds trainable prompts (see the class
        docstring).

        Routing controls apply to every inference session of the model (peerd.sdk.client's
        route_options): allowed_servers / blocked_servers (peer ids), max_retries,
        connect_timeout, request_timeout; show_route prints each session's route to stderr.

        Raises peerd.sdk.client.DaemonNotRunning when no daemon answers, ModelMismatch when the
        daemon runs another model than `model`, and BadRouteOptions for a malformed peer id.
        """
        if int(transformers.__version__.split(".")[0]) < 5:
            raise ImportError(
                f"peerd.sdk.model needs transformers 5 or later (its generate hands the KV cache "
                f"to the model as `cache`), not {transformers.__version__}: upgrade transformers"
            )
        _check_tuning(tuning_mode, pre_seq_len, active_adapter)
        checkpoint = blocks.resolve_checkpoint(model)
        config = blocks.load_config(checkpoint)
        daemon = DaemonConnection(
            socket,
            timeout=timeout,
            allowed_servers=allowed_servers,
            blocked_servers=blocked_servers,
            max_retries=max_retries,
            connect_timeout=connect_timeout,
            request_timeout=request_timeout,
            show_route=show_route,
        )
        try:
            _check_same_model(daemon.client, checkpoint, config)
            client_side = blocks.load_client_side(checkpoint, dtype=dtype, device=device)
        except BaseException:
            daemon.close()
            raise
        generation_config = None
        if (checkpoint / "generation_config.json").is_file():
            generation_config = GenerationConfig.from_pretrained(checkpoint, local_files_only=True)
        return cls(
            client_side.config,
            client_side,
            daemon,
            generation_config,
            active_adapter,
            tuning_mode=tuning_mode,
            pre_seq_len=pre_seq_len,
        )

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing to initialise: every local weight comes from the checkpoint."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the only cache is a RemoteSession: never let generate make a local one

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.client_side.embeddings

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.client_side.lm_head

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (with its chat template)."""
        return self.client_side.tokenizer

    def close(self) -> None:
        """Hang up on the daemon (which frees any session still open)."""
        self.daemon.close()

    # --- sessions ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def inference_session(
        self, max_length: int, batch_size: int = 1, left_padding: tuple[int, ...] = ()
    ) -> Iterator[RemoteSession]:
        """A session on the swarm that every `generate` call inside the `with` block continues:
        the servers keep their caches between calls, so each call feeds only what is new. Pass
        each call only the tokens to add (or none); it returns the whole sequence so far.
        `left_padding`: per row, the padding positions its first tokens will be."""
        if self.active_session is not None:
            raise RuntimeError("an inference session is already active on this model")
        with RemoteSession(
            self.daemon,
            max_length=max_length,
            batch_size=batch_size,
            adapter=self.active_adapter,
            left_padding=left_padding,
        ) as session:
            self.active_session = session
            try:
                yield session
            finally:
                self.active_session = None

    # --- forward ----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple[Any, ...]:
        """Logits (and, on request, hidden states and loss) of the tokens given. Without a cache
        the tokens go through the swarm in a session of their own; with `cache=` a RemoteSession
        they extend it."""
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
        if self.tuning_mode is not None:
            return self._tuned_forward(
                input_ids, inputs_embeds, cache, labels, output_hidden_states, return_dict
            )
        if inputs_embeds is not None:
            embed_norm = self.client_side.embed_norm
            hidden_in = embed_norm(inputs_embeds) if embed_norm is not None else inputs_embeds
        else:
            assert input_ids is not None
            hidden_in = self.client_side.embed(input_ids)
        if cache is None and torch.is_grad_enabled() and hidden_in.requires_grad:
            # Gradients wanted (of inputs_embeds): a cache-less pass that autograd goes back
            # through (a session step's servers keep no autograd graph).
            if self.active_adapter is not None:
                raise ValueError(_NO_TRAINING_ADAPTER)
            hidden_out = remote_blocks(self.daemon, hidden_in.to("cpu", torch.float32), None)
            return self._outputs(
                hidden_in,
                hidden_out,
                None,
                labels,
                logits_to_keep,
                output_hidden_states,
                return_dict,
            )
        past = cache.position if cache is not None else 0
        padding = left_padding_of(attention_mask) if attention_mask is not None else ()
        if cache is not None and any(padding) and padding != cache.left_padding:
            raise ValueError(
                f"attention_mask pads the rows by {list(padding)}, the session was opened with "
                f"left_padding {list(cache.left_padding)}: open it with the mask's padding "
                "(generate does, from attention_mask)"
            )
        if position_ids is not None:
            # The last token of each row, counted without the row's padding.
            held = cache.left_padding if cache is not None else padding
            pads = torch.tensor(held) if held else torch.tensor(0)
            expected = past + hidden_in.shape[1] - 1 - pads
            if bool((position_ids[..., -1].cpu() != expected).any()):
                raise ValueError(
                    f"these tokens end at positions {position_ids[..., -1].tolist()}, but the "
                    f"servers hold {past}: give only the tokens the session has not seen"
                )
        to_send = hidden_in.to("cpu", torch.float32)
        if cache is not None:
            hidden_out = cache.step(to_send, input_ids)
        else:
            with RemoteSession(
                self.daemon,
                max_length=to_send.shape[1],
                batch_size=to_send.shape[0],
                adapter=self.active_adapter,
                left_padding=padding if any(padding) else (),
            ) as own:
                hidden_out = own.step(to_send, input_ids)
        return self._outputs(
            hidden_in, hidden_out, cache, labels, logits_to_keep, output_hidden_states, return_dict
        )

    def _outputs(
        self,
        hidden_in: torch.Tensor,
        hidden_out: torch.Tensor,
        cache: RemoteSession | None,
        labels: torch.LongTensor | None,
        logits_to_keep: int,
        output_hidden_states: bool | None,
        return_dict: bool | None,
    ) -> CausalLMOutputWithPast | tuple[Any, ...]:
        """Final norm, LM head and loss on the last block's output."""
        weight = self.client_side.lm_head.weight
        last_hidden = self.client_side.final_norm(hidden_out.to(weight.device, weight.dtype))
        kept = last_hidden[:, -logits_to_keep:] if logits_to_keep else last_hidden
        logits = self.client_side.lm_head(kept)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        if output_hidden_states is None:
            output_hidden_states = bool(self.config.output_hidden_states)
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=cache,
            hidden_states=(hidden_in, last_hidden) if output_hidden_states else None,
        )
        return output.to_tuple() if return_dict is False else output

    def _tuned_forward(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        cache: Cache | None,
        labels: torch.LongTensor | None,
        output_hidden_states: bool | None,
        return_dict: bool | None,
    ) -> CausalLMOutputWithPast | tuple[Any, ...]:
        """A forward with the trained prompts: the shallow ones before the tokens, the deep ones
        sent along for every block, the prefix positions cut from the outputs."""
        if cache is not None:
            raise UnsupportedGeneration(_NO_TUNED_SESSIONS)
        assert self.prompt_embeddings is not None
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.client_side.embeddings(
                input_ids.to(self.client_side.embeddings.weight.device)
            )
        batch = inputs_embeds.shape[0]
        shallow = self.prompt_embeddings.unsqueeze(0).expand(batch, -1, -1)
        embeds = torch.cat([shallow.to(inputs_embeds.dtype), inputs_embeds], dim=1)
        embed_norm = self.client_side.embed_norm
        hidden_in = embed_norm(embeds) if embed_norm is not None else embeds
        deep = self.intermediate_prompt_embeddings
        prompts = None if deep is None else deep.unsqueeze(1).to("cpu", torch.float32)
        hidden_out = remote_blocks(self.daemon, hidden_in.to("cpu", torch.float32), prompts)
        prefix = self.pre_seq_len
        return self._outputs(
            hidden_in[:, prefix:],
            hidden_out[:, prefix:],
            None,
            labels,
            0,
            output_hidden_states,
            return_dict,
        )

    # --- generation -------------------------------------------------------------------------

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        session: RemoteSession | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' `generate` (greedy or sampling) through the swarm.

        Inside `with model.inference_session(...)` (or with `session=`), the call continues that
        session: `inputs` are only the tokens to add after what it holds (None to just go on),
        and the result is the whole sequence so far. Otherwise the call opens a session sized
        prompt + max_new_tokens and closes it at the end.
        """
        if self.tuning_mode is not None:
            raise UnsupportedGeneration(_NO_TUNED_SESSIONS)
        if inputs is None:
            inputs = kwargs.pop("input_ids", None)
        # The settings generate itself will use (its own resolution of defaults and kwargs).
        config, _ = self._prepare_generation_config(generation_config, **kwargs)  # type: ignore[misc]
        mode = config.get_generation_mode(kwargs.get("assistant_model"))
        if mode not in SUPPORTED_MODES:
            reason = _NO_BEAMS if "beam" in mode.value else _NO_REWIND
            raise UnsupportedGeneration(f"{mode.value} does not work through the swarm: {reason}")
        if config.use_cache is False:
            raise ValueError(
                "use_cache=False would send the whole sequence through the swarm at every token; "
                "the servers keep the cache, so leave use_cache on"
            )
        if session is None:
            session = self.active_session
        if session is not None:
            return self._generate_in(session, inputs, generation_config, config, kwargs)
        prompt = _prompt_length(inputs, kwargs)
        rows = _batch_size(inputs, kwargs) * (config.num_return_sequences or 1)
        length = prompt + self._new_tokens(config, generation_config, kwargs, prompt)
        mask = kwargs.get("attention_mask")
        padding = left_padding_of(mask) if mask is not None else ()
        if any(padding) and rows != len(padding):
            raise ValueError("num_return_sequences > 1 works only with unpadded prompts")
        with RemoteSession(
            self.daemon,
            max_length=max(length, 1),
            batch_size=rows,
            adapter=self.active_adapter,
            left_padding=padding if any(padding) else (),
        ) as own:
            return self._generate_in(own, inputs, generation_config, config, kwargs)

    def _generate_in(
        self,
        session: RemoteSession,
        inputs: torch.Tensor | None,
        generation_config: GenerationConfig | None,
        config: GenerationConfig,
        kwargs: dict[str, Any],
    ) -> Any:
        if session.position > 0:
            held = session.output_ids
            if held is None:
                raise ValueError(
                    "this session was fed embeddings, so its token ids are unknown and generate "
                    "cannot continue it; continue it with model(..., cache=session)"
                )
            if "inputs_embeds" in kwargs:
                raise ValueError("a session that holds tokens continues from input_ids only")
            if (config.num_return_sequences or 1) > 1:
                raise ValueError("num_return_sequences > 1 works only in a fresh session")
            # The previous tokens go in too, for logits processors (repetition penalty...);
            # generate sends only those past session.position through the swarm.
            inputs = held if inputs is None else torch.cat([held, inputs.to(held.device)], 1)
            if inputs.shape[1] <= session.position:
                raise ValueError(
                    "the servers already hold every token of this sequence: pass the tokens to add"
                )
        prompt = _prompt_length(inputs, kwargs)
        rows = _batch_size(inputs, kwargs) * (config.num_return_sequences or 1)
        if rows != session.batch_size:
            raise ValueError(
                f"the session was opened for batch size {session.batch_size}, this call has {rows}"
            )
        needed = prompt + self._new_tokens(config, generation_config, kwargs, prompt) - 1
        if needed > session.max_length:
            raise ValueError(
                f"this call would put {needed} tokens in a session of max_length "
                f"{session.max_length}: open a longer inference_session"
            )
        result = super().generate(inputs, generation_config, cache=session, **kwargs)
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        # What generate saw (prompt + sampled), which the servers hold but for the last token.
        session.output_ids = sequences if sequences.shape[1] >= session.position else None
        return result

    def _new_tokens(
        self,
        config: GenerationConfig,
        generation_config: GenerationConfig | None,
        kwargs: dict[str, Any],
        prompt: int,
    ) -> int:
        """How many tokens generate may add, resolved the way transformers does."""
        if config.max_new_tokens is not None:
            return int(config.max_new_tokens)
        max_length_set = any(
            c is not None and c.max_length is not None
            for c in (generation_config, self.generation_config)
        )
        if kwargs.get("max_length") is not None or max_length_set:
            return max(int(config.max_length) - prompt, 0)
        return int(config.max_length)  # transformers' default: that many new tokens


def left_padding_of(attention_mask: torch.Tensor) -> tuple[int, ...]:
    """Per row, the padding positions at the start of a [batch, tokens] attention mask (zeros,
    then ones, as a tokenizer with padding_side="left" makes); ValueError for any other mask."""
    mask = attention_mask.to("cpu", torch.long)
    if mask.ndim != 2:
        raise ValueError(f"attention_mask must be [batch, tokens], got {list(mask.shape)}")
    padding = (mask == 0).sum(dim=1)
    columns = torch.arange(mask.shape[1])[None]
    if not bool((mask == (columns >= padding[:, None]).long()).all()):
        raise ValueError(
            "attention_mask must hold zeros then ones per row (left padding): the servers skip "
            "a row's first positions only; pad on the left (tokenizer.padding_side = 'left')"
        )
    if bool((padding == mask.shape[1]).any()):
        raise ValueError("a row of attention_mask is all padding: give each row a token")
    return tuple(int(p) for p in padding)


def _prompt_length(inputs: torch.Tensor | None, kwargs: dict[str, Any]) -> int:
    if inputs is not None:
        return int(inputs.shape[1])
    if kwargs.get("inputs_embeds") is not None:
        return int(kwargs["inputs_embeds"].shape[1])
    return 1  # generate starts from the BOS token


def _batch_size(inputs: torch.Tensor | None, kwargs: dict[str, Any]) -> int:
    if inputs is not None:
        return int(inputs.shape[0])
    if kwargs.get("inputs_embeds") is not None:
        return int(kwargs["inputs_embeds"].shape[0])
    return 1


def _check_tuning(tuning_mode: str | None, pre_seq_len: int, adapter: str | None) -> int:
    """pre_seq_len, checked against tuning_mode; ValueError says what to pass."""
    if tuning_mode is not None and adapter is not None:
        raise ValueError(_NO_TRAINING_ADAPTER)
    if tuning_mode is None:
        if pre_seq_len:
            raise ValueError("pre_seq_len needs a tuning_mode: 'ptune' or 'deep_ptune'")
        return 0
    if tuning_mode not in TUNING_MODES:
        raise ValueError(f"tuning_mode must be 'ptune' or 'deep_ptune', not {tuning_mode!r}")
    if pre_seq_len < 1:
        raise ValueError(f"tuning_mode {tuning_mode!r} needs pre_seq_len >= 1 prompt positions")
    return pre_seq_len


def _check_same_model(client: Client, checkpoint: Path, config: PretrainedConfig) -> None:
    welcome = client.welcome
    ours = blocks.model_name(checkpoint)
    problems = []
    if welcome.model != ours:
        problems.append(f"it runs {welcome.model}, not {ours}")
    if welcome.num_blocks != config.num_hidden_layers:
        problems.append(f"{welcome.num_blocks} blocks, not {config.num_hidden_layers}")
    if welcome.hidden_size != config.hidden_size:
        problems.append(f"hidden size {welcome.hidden_size}, not {config.hidden_size}")
    if problems:
        raise ModelMismatch(
            f"the daemon on {client.path} serves another model than {checkpoint} "
            f"({'; '.join(problems)}): load its model instead, or start a daemon for this one "
            f"with `peerd start --model {checkpoint}` (and --socket to run it beside the first)"
        )


# The name Petals and transformers users reach for: one class serves every model family, since
# the family-specific parts (embeddings, norms, head) come from blocks.load_client_side.
AutoDistributedModelForCausalLM = DistributedModelForCausalLM
