"""Token generation through the swarm: prefill, decode one token at a time, sample.

The client holds the embeddings and LM head (blocks.ClientSide); the decoder blocks are remote,
behind an InferenceSession. The LM head and sampling, the one heavy torch call here, run on the
process's compute thread (peerd.node.compute_thread; batched over concurrent generations by a
Coalescer) so the event loop keeps serving streams meanwhile, except for a lone generation whose
pass is short (INLINE_MAX_S) and single-threaded: then on the loop, as the embedding look-up of a
step's few tokens always does, where it costs less than the hand-off would. A single prompt is a
batch of one: every path takes [batch, tokens] ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from blocks import ClientSide, GenerationDefaults
from blocks import threads as torch_threads
from peerd.node import compute_thread
from peerd.session.coalesce import Coalescer
from peerd.session.drafting import Drafter, DraftModel, PromptLookup, load_draft_model
from peerd.session.inference import InferenceSession
from peerd.session.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    logits_to_probs,
    sample,
    sampling_generator,
)
from peerd.session.speculative import Speculation, SpeculativeDecoder, Tally, policy_for
from peerd.session.swarm import SwarmView

__all__ = [
    "Generator",
    "SamplingParams",
    "Speculation",
    "Tally",
    "apply_repetition_penalty",
    "encode_prompt",
    "left_pad",
    "logits_to_probs",
    "sample",
    "sampling_generator",
    "with_defaults",
]

# A lone generation's LM-head pass runs on the event loop once such a pass took at most this
# long (7 ms for the default model on the 2-core development machine, where handing it to a
# worker thread and back cost ~0.6 ms of each token), if it runs on one torch thread.
INLINE_MAX_S = 0.05
# Concurrent generations, once SPLIT_GENERATIONS or more, take their LM-head passes and steps in
# MICRO_BATCHES groups (wire.Step.micro_batch): with one group, every hop of the route and the
# client wait in turn for the group's one merged forward, and while one computes the others sit
# idle; with two, one group's forward runs on a hop while the other's runs on the next. A forward
# of fewer rows is cheaper on a CPU (10 blocks of the default model on one core: 8 merged rows
# ~30 ms, 4 rows ~20 ms), so 8 sessions through three local daemons on two cores made 58-59
# tokens/s in two groups against 41-54 in one (bench batch, docs/swarm.md). On a GPU a forward
# of 4 rows costs what one of 8 does: there the split would only double the servers' forwards,
# so only generations whose every server says it computes on a CPU (its record's `device`) split.
MICRO_BATCHES = 2
SPLIT_GENERATIONS = 4


def with_defaults(params: SamplingParams, defaults: GenerationDefaults) -> SamplingParams:
    """`params` with the checkpoint's generation_config.json values where the request left the
    local API's default: repetition_penalty 1.0; when sampling, temperature 1.0 and no top_k or
    top_p. A value the request sets wins. Greedy stays greedy: the wire cannot tell "greedy" asked
    for from nothing asked, so do_sample is the request's alone (docs/blocks.md#hub-checkpoints)."""
    if params.repetition_penalty == 1.0 and defaults.repetition_penalty is not None:
        params = dataclasses.replace(params, repetition_penalty=defaults.repetition_penalty)
    if not params.do_sample:
        return params
    if params.temperature == 1.0 and defaults.temperature is not None:
        params = dataclasses.replace(params, temperature=defaults.temperature)
    if params.top_k is None and defaults.top_k is not None:
        params = dataclasses.replace(params, top_k=defaults.top_k)
    if params.top_p is None and defaults.top_p is not None:
        params = dataclasses.replace(params, top_p=defaults.top_p)
    return params


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Token ids of prompts of different lengths as one [batch, longest] tensor, padded on the
    left with `pad_id`, and how many padding positions each row got."""
    width = max(len(row) for row in rows)
    padding = tuple(width - len(row) for row in rows)
    ids = [[pad_id] * pad + list(row) for pad, row in zip(padding, rows, strict=True)]
    return torch.tensor(ids, dtype=torch.long), padding


def encode_prompt(tokenizer: Any, text: str, *, chat: bool) -> torch.Tensor:
    """[1, tokens] input ids of `text`, wrapped in the model's chat template when `chat`."""
    if chat:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
    else:
        encoded = tokenizer(text, return_tensors="pt")
    return torch.as_tensor(encoded["input_ids"])


@dataclass(frozen=True)
class _NextToken:
    hidden: torch.Tensor  # [batch, hidden] after the last block, at the last position
    token_ids: torch.Tensor  # the sequence so far (repetition penalty)
    params: SamplingParams
    generator: torch.Generator


class Generator:
    """Generates tokens for prompts, running the blocks through the swarm."""

    def __init__(self, client: ClientSide, swarm: SwarmView) -> None:
        self.client = client
        self.swarm = swarm
        # Concurrent generations (local clients, gateway users) share LM-head passes.
        self._next_tokens = Coalescer(
            self._sample_rows,
            run_sync=compute_thread.run,
            inline_max_s=INLINE_MAX_S if torch_threads.POLICY.threads_for(1) == 1 else 0.0,
            micro_batches=MICRO_BATCHES,
            split_members=SPLIT_GENERATIONS,
        )

    def _sample_rows(self, requests: list[_NextToken]) -> list[torch.Tensor]:
        """The next token of each request, with one LM-head pass over all their rows."""
        torch_threads.apply(sum(r.hidden.shape[0] for r in requests))
        sizes = [r.hidden.shape[0] for r in requests]
        with torch.inference_mode():
            hidden = torch.cat([r.hidden for r in requests])
            if all(_plain_greedy(r.params) for r in requests):
                # Only the argmax is needed: the head may take its half-precision shortlist.
                return list(self.client.greedy(hidden).split(sizes))
            rows = self.client.logits(hidden).split(sizes)
            return [
                sample(row, r.token_ids, r.params, r.generator)
                for row, r in zip(rows, requests, strict=True)
            ]

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.client.embed(token_ids)

    async def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams | None = None,
        *,
        session: InferenceSession | None = None,
        eos_token_ids: Sequence[int] = (),
        adapter: str | None = None,
        left_padding: tuple[int, ...] = (),
        speculate: Speculation | None = None,
        tally: Tally | None = None,
    ) -> AsyncGenerator[torch.Tensor, None]:
        """Yield [batch, 1] token ids one step at a time (stops early when every row hit EOS;
        a row that did keeps being fed its samples, which no other row sees).

        With `session`, the prompt continues that session's sequence (a new chat turn);
        otherwise a session sized for prompt + max_new_tokens is opened and closed here, with
        LoRA `adapter` on every hop when given, and `left_padding` (per row: padding positions at
        the start of `input_ids`).

        `speculate` (a batch of one only; larger batches decode plainly): drafts checked by the
        swarm several tokens a pass, the same tokens (greedy) or the same distribution
        (sampling) as plain decoding (peerd.session.speculative); `tally`, when given, counts
        its passes and drafts.
        """
        params = with_defaults(params or SamplingParams(), self.client.generation_defaults)
        generator = sampling_generator(params.seed)
        async with contextlib.AsyncExitStack() as own:
            if session is None:
                session = await own.enter_async_context(
                    InferenceSession(
                        self.swarm,
                        max_length=input_ids.shape[1] + max_new_tokens,
                        batch_size=input_ids.shape[0],
                        adapter=adapter,
                        left_padding=left_padding,
                        open_with_first_step=True,
                    )
                )
            if speculate is not None and speculate.on and input_ids.shape[0] == 1:
                decoder = await compute_thread.run(
                    self.speculative_decoder, speculate, params, generator
                )
                decoder.tally = tally if tally is not None else decoder.tally
                tokens = decoder.decode(session, input_ids, max_new_tokens, eos_token_ids)
            else:
                tokens = self._decode(
                    session, input_ids, max_new_tokens, params, generator, eos_token_ids
                )
            async with contextlib.aclosing(tokens):
                async for token in tokens:
                    yield token

    def speculative_decoder(
        self, speculate: Speculation, params: SamplingParams, generator: torch.Generator
    ) -> SpeculativeDecoder:
        """A decoder for one generation with the drafter `speculate` names (a draft model is
        loaded once per path, which may take seconds: call it in a worker thread;
        DraftModelError saying what to do when it cannot be)."""
        drafter: Drafter
        if speculate.mode == "draft":
            assert speculate.draft_path is not None
            model = load_draft_model(speculate.draft_path, lambda: self.client.tokenizer)
            drafter = DraftModel(model, self.client.embeddings.num_embeddings)
        else:
            drafter = PromptLookup()
        return SpeculativeDecoder(
            self._embed, self.client.logits, drafter, policy_for(speculate), params, generator
        )

    async def _decode(
        self,
        session: InferenceSession,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
        eos_token_ids: Sequence[int],
    ) -> AsyncGenerator[torch.Tensor, None]:
        token_ids = input_ids
        step_input = input_ids
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        eos = torch.tensor(list(eos_token_ids), dtype=torch.long)
        me = object()  # our calls of the LM head: concurrent generations wait for each other
        try:
            with self._next_tokens.member(me, split=_on_cpus(session)):
                for _ in range(max_new_tokens):
                    # A table look-up of a few rows: cheaper here than a hand-off to a thread.
                    hidden = self._embed(step_input)
                    session.micro_batch = self._next_tokens.group_of(me)
                    hidden = await session.step(hidden, keep_last=1)  # a prompt's last only
                    next_token = _NextToken(hidden[:, -1], token_ids, params, generator)
                    token = await self._next_tokens(next_token, me)
                    yield token
                    token_ids = torch.cat([token_ids, token], dim=1)
                    step_input = token
                    if len(eos):
                        finished |= torch.isin(token[:, 0], eos)
                        if bool(finished.all()):
                            return
        finally:
            session.micro_batch = None  # a session used on (a chat's next turn) starts ungrouped


def _plain_greedy(params: SamplingParams) -> bool:
    """The next token is the logits' argmax, as `sample` picks it without sampling or penalty."""
    return not params.do_sample and params.repetition_penalty == 1.0


def _on_cpus(session: InferenceSession) -> bool:
    """Every server of the session's route computes on a CPU (MICRO_BATCHES)."""
    return all(hop.record.device == "cpu" for hop in session.route)
