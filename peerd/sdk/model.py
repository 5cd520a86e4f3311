"""The transformers-compatible model: a `PreTrainedModel` whose decoder blocks run on the swarm.

    from peerd.model import AutoDistributedModelForCausalLM
    model = AutoDistributedModelForCausalLM.from_pretrained("default")  # the local daemon's model
    ids = model.tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    print(model.tokenizer.decode(model.generate(ids, max_new_tokens=32)[0]))

Only the embeddings, the final norm and the LM head live in this process (blocks.ClientSide);
hidden states go through every block via the local daemon's socket (peerd.sdk.client.Client),
and the servers keep the KV caches. transformers' own GenerationMixin drives generation: the
cache it threads through `forward` is a `RemoteSession`, which holds no keys or values, only how
many tokens the servers hold, so `generate` feeds each token once. Greedy decoding and sampling
work; beam search and assisted decoding would need the servers to reorder or crop their caches,
which the local API does not offer, so they raise `UnsupportedGeneration`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

import blocks
from peerd.sdk.client import DEFAULT_TIMEOUT_S
from peerd.sdk.model_checks import (
    NO_BEAMS,
    NO_REWIND,
    NO_TRAINING_ADAPTER,
    NO_TUNED_SESSIONS,
    SUPPORTED_MODES,
    ModelMismatch,
    TuningMode,
    UnsupportedGeneration,
    batch_size,
    check_same_model,
    check_tuning,
    client_config,
    generation_config_of,
    left_padding_of,
    new_tokens,
    prompt_length,
    require_transformers_5,
)
from peerd.sdk.model_speculative import speculative_generate, wants_speculation
from peerd.sdk.remote import (
    DaemonConnection,
    RemoteBlocks,
    RemoteSession,
    check_positions,
    remote_blocks,
    remote_cache,
)

__all__ = [
    "AutoDistributedModelForCausalLM",
    "DaemonConnection",
    "DistributedModelForCausalLM",
    "ModelMismatch",
    "RemoteBlocks",
    "RemoteSession",
    "UnsupportedGeneration",
    "left_padding_of",
]


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
        super().__init__(client_config(config))
        self.client_side = client_side
        self.daemon = daemon
        # The LoRA adapter sessions opened from now on run with (None: the base model); set it
        # to switch, as with peft's set_adapter. Servers without it are not routed through.
        self.active_adapter = active_adapter
        self.active_session: RemoteSession | None = None
        if generation_config is not None:
            self.generation_config = generation_config
        self.tuning_mode = tuning_mode
        self.pre_seq_len = check_tuning(tuning_mode, pre_seq_len, active_adapter)
        self.prompt_embeddings: nn.Parameter | None = None
        self.intermediate_prompt_embeddings: nn.Parameter | None = None
        if tuning_mode is not None:
            self._add_prompts(tuning_mode, pre_seq_len)
        self.post_init()

    def _add_prompts(self, tuning_mode: TuningMode, pre_seq_len: int) -> None:
        """The trainable prompts: shallow ones at random (as the config initialises weights),
        deep ones, per block, at zero (so a fresh deep_ptune model is the base model)."""
        weight = self.client_side.embeddings.weight
        hidden, blocks_count = int(self.config.hidden_size), int(self.config.num_hidden_layers)
        std = float(getattr(self.config, "initializer_range", 0.02))
        self.prompt_embeddings = nn.Parameter(
            torch.randn(pre_seq_len, hidden, dtype=weight.dtype, device=weight.device) * std
        )
        if tuning_mode == "deep_ptune":
            self.intermediate_prompt_embeddings = nn.Parameter(
                weight.new_zeros(blocks_count, pre_seq_len, hidden)
            )

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
        require_transformers_5()
        check_tuning(tuning_mode, pre_seq_len, active_adapter)
        checkpoint = blocks.resolve_checkpoint(model)
        routing = {
            "allowed_servers": allowed_servers,
            "blocked_servers": blocked_servers,
            "max_retries": max_retries,
            "connect_timeout": connect_timeout,
            "request_timeout": request_timeout,
            "show_route": show_route,
        }
        daemon = DaemonConnection(socket, timeout=timeout, **routing)
        try:
            check_same_model(daemon.client, checkpoint, blocks.load_config(checkpoint))
            client_side = blocks.load_client_side(checkpoint, dtype=dtype, device=device)
        except BaseException:
            daemon.close()
            raise
        return cls(
            client_side.config,
            client_side,
            daemon,
            generation_config_of(checkpoint),
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
        cache = remote_cache(input_ids, inputs_embeds, cache, output_attentions, kwargs)
        if self.tuning_mode is not None:
            return self._tuned_forward(
                input_ids, inputs_embeds, cache, labels, output_hidden_states, return_dict
            )
        hidden_in = self._embed(input_ids, inputs_embeds)
        if cache is None and torch.is_grad_enabled() and hidden_in.requires_grad:
            # Gradients wanted (of inputs_embeds): a cache-less pass that autograd goes back
            # through (a session step's servers keep no autograd graph).
            if self.active_adapter is not None:
                raise ValueError(NO_TRAINING_ADAPTER)
            hidden_out = remote_blocks(self.daemon, hidden_in.to("cpu", torch.float32), None)
        else:
            padding = left_padding_of(attention_mask) if attention_mask is not None else ()
            check_positions(cache, padding, position_ids, hidden_in.shape[1])
            hidden_out = self._step(hidden_in, input_ids, cache, padding)
        return self._outputs(
            hidden_in, hidden_out, cache, labels, logits_to_keep, output_hidden_states, return_dict
        )

    def _embed(
        self, input_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        """What the first block takes: the embeddings of input_ids, or inputs_embeds as given
        (after the family's embedding norm, if it has one)."""
        if inputs_embeds is None:
            assert input_ids is not None
            return self.client_side.embed(input_ids)
        embed_norm = self.client_side.embed_norm
        return embed_norm(inputs_embeds) if embed_norm is not None else inputs_embeds

    def _step(
        self,
        hidden_in: torch.Tensor,
        input_ids: torch.Tensor | None,
        cache: RemoteSession | None,
        padding: tuple[int, ...],
    ) -> torch.Tensor:
        """The last block's output for `hidden_in`, extending `cache`, else in a session of its
        own (opened, stepped once, closed)."""
        to_send = hidden_in.to("cpu", torch.float32)
        if cache is not None:
            return cache.step(to_send, input_ids)
        with RemoteSession(
            self.daemon,
            max_length=to_send.shape[1],
            batch_size=to_send.shape[0],
            adapter=self.active_adapter,
            left_padding=padding if any(padding) else (),
        ) as own:
            return own.step(to_send, input_ids)

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
            raise UnsupportedGeneration(NO_TUNED_SESSIONS)
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
            raise UnsupportedGeneration(NO_TUNED_SESSIONS)
        if inputs is None:
            inputs = kwargs.pop("input_ids", None)
        # The settings generate itself will use (its own resolution of defaults and kwargs).
        config, _ = self._prepare_generation_config(generation_config, **kwargs)  # type: ignore[misc]
        if wants_speculation(config, kwargs):  # the daemon's speculative decoding, not HF's
            given = (generation_config, self.generation_config)
            return speculative_generate(self, inputs, config, given, session, kwargs)
        mode = config.get_generation_mode(kwargs.get("assistant_model"))
        if mode not in SUPPORTED_MODES:
            reason = NO_BEAMS if "beam" in mode.value else NO_REWIND
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
        prompt = prompt_length(inputs, kwargs)
        rows = batch_size(inputs, kwargs) * (config.num_return_sequences or 1)
        length = prompt + new_tokens(
            config, (generation_config, self.generation_config), kwargs, prompt
        )
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
        prompt = prompt_length(inputs, kwargs)
        rows = batch_size(inputs, kwargs) * (config.num_return_sequences or 1)
        if rows != session.batch_size:
            raise ValueError(
                f"the session was opened for batch size {session.batch_size}, this call has {rows}"
            )
        needed = (
            prompt
            + new_tokens(config, (generation_config, self.generation_config), kwargs, prompt)
            - 1
        )
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


# The name Petals and transformers users reach for: one class serves every model family, since
# the family-specific parts (embeddings, norms, head) come from blocks.load_client_side.
AutoDistributedModelForCausalLM = DistributedModelForCausalLM
