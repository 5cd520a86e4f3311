"""Picking tokens from logits: repetition penalty, temperature, top-k, top-p, the random source.

Plain decoding (peerd.session.generation) and speculative decoding (peerd.session.speculative)
both use these, so a token is judged the same way whichever path produced it.
"""

from __future__ import annotations

import torch

import wire

SamplingParams = wire.Sampling
"""How to pick the next token: the local API's own record (validated on decode), defaults greedy."""


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[batch, vocab] logits -> probabilities after temperature, top-k and top-p."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def apply_repetition_penalty(
    logits: torch.Tensor, token_ids: torch.Tensor, penalty: float
) -> torch.Tensor:
    """CTRL-style penalty (as transformers applies it) on tokens already in the sequence."""
    if penalty == 1.0:
        return logits
    seen = torch.gather(logits, -1, token_ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, token_ids, seen)


def sample(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> torch.Tensor:
    """[batch, vocab] logits of the last position -> [batch, 1] next token ids."""
    logits = apply_repetition_penalty(logits.float(), token_ids, params.repetition_penalty)
    if not params.do_sample:
        return logits.argmax(dim=-1, keepdim=True)
    probs = logits_to_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator)


def sampling_generator(seed: int | None) -> torch.Generator:
    """The random source of one generation: `seed` makes it reproducible; without one it starts
    from fresh OS entropy (a bare torch.Generator() always starts from the same default seed, so
    every unseeded generation would sample the same text)."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
