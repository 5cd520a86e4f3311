"""Drafters for speculative decoding: cheap guesses of the next few tokens, made on the client,
that the swarm then checks in one pass (peerd.session.speculative).

Two kinds: prompt lookup (the last few tokens matched earlier in the prompt and the text so far,
and the tokens that followed there proposed again; no model, costs nothing) and a draft model
(any small local checkpoint with the model's tokenizer, run here with a KV cache of its own).
A draft is only a guess: a wrong one costs a little compute, never a different output.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from peerd.session.sampling import SamplingParams, apply_repetition_penalty, logits_to_probs

# Longest and shortest suffix of the text that prompt lookup looks for earlier in it (the
# longest match found wins, as in transformers' prompt lookup). A one-token match is often chance
# in open text, but in a rewrite it finds the place being copied from after an edit (20% fewer
# passes on the spec bench's copy prompt); `auto` stops drafting where such drafts fall.
MAX_NGRAM = 3
MIN_NGRAM = 1


@dataclass(frozen=True)
class Draft:
    """Proposed tokens and, when they were sampled from a distribution, that distribution at
    each of them ([len(tokens), vocab]; None: chosen deterministically, a point mass)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes up to `k` tokens to follow `sequence` (the whole text so far). Runs in a worker
    thread unless it has `cheap = True` (no model: faster than the hand-off)."""

    def propose(
        self, sequence: Sequence[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Draft: ...


class PromptLookup:
    """Prompt lookup decoding: find the latest earlier occurrence of the text's last n tokens
    (n from MAX_NGRAM down to MIN_NGRAM) and propose the k tokens that followed it."""

    cheap = True  # a list search: run on the event loop, not in a worker thread

    def propose(
        self, sequence: Sequence[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Draft:
        return Draft(lookup(sequence, k))


def lookup(sequence: Sequence[int], k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the sequence's longest
    matching suffix (MAX_NGRAM..MIN_NGRAM tokens); [] when nothing matches."""
    if k <= 0:
        return []
    seq = list(sequence)
    for n in range(min(MAX_NGRAM, len(seq) - 1), MIN_NGRAM - 1, -1):
        suffix = seq[-n:]
        # Latest match first: in a rewrite, the place we are copying from moves along with us.
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                follow = seq[start + n : start + n + k]
                if follow:
                    return follow
    return []


class DraftModel:
    """A small causal LM with the target model's tokenizer, run on the client. One instance per
    generation (it holds that generation's KV cache); the weights are shared (`load_draft_model`).
    Called from worker threads, one call at a time."""

    def __init__(self, model: Any, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's: drafts and probabilities are cut to it
        self.cache: Any = None
        parameters = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds

    def propose(
        self, sequence: Sequence[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Draft:
        if k <= 0:
            return Draft([])
        seq = list(sequence)
        with torch.inference_mode():
            logits = self._feed(seq)
            tokens: list[int] = []
            probs: list[torch.Tensor] = []
            for i in range(k):
                ids = torch.tensor([seq + tokens])
                row = apply_repetition_penalty(logits[None], ids, params.repetition_penalty)
                if params.do_sample:
                    p = logits_to_probs(row, params)[0]
                    token = int(torch.multinomial(p, 1, generator=generator))
                    probs.append(p)
                else:
                    token = int(row.argmax())
                tokens.append(token)
                if i + 1 < k:
                    logits = self._forward([token])
        return Draft(tokens, torch.stack(probs) if probs else None)

    def _feed(self, seq: list[int]) -> torch.Tensor:
        """Bring the cache to `seq` (keeping the prefix it shares with what it holds) and
        return the logits after its last token."""
        from transformers import DynamicCache

        common = 0
        limit = min(len(self.cached), len(seq) - 1)  # the last token is always fed: its logits
        while common < limit and self.cached[common] == seq[common]:
            common += 1
        if self.cache is None or common == 0:
            self.cache, self.cached = DynamicCache(), []
            common = 0
        elif common < len(self.cached):
            self.cache.crop(common - len(self.cached))  # how many to drop, as a negative count
            self.cached = self.cached[:common]
        return self._forward(seq[common:])

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        # transformers 5 names the cache argument `cache` (past_key_values before): the cache
        # object is updated in place either way.
        cache = {self._cache_arg: self.cache}
        out = self.model(input_ids=torch.tensor([tokens]), use_cache=True, **cache)
        self.cached.extend(tokens)
        logits = out.logits[0, -1].float()
        if logits.shape[0] >= self.vocab_size:
            return logits[: self.vocab_size]
        pad = torch.full((self.vocab_size - logits.shape[0],), float("-inf"))
        return torch.cat([logits, pad])


class DraftModelError(ValueError):
    """A draft model that cannot be used; the message says what to do."""


_loaded: dict[str, Any] = {}
_loading = threading.Lock()


def load_draft_model(path: str, tokenizer: Callable[[], Any]) -> Any:
    """The causal LM at `path` (a local checkpoint directory), loaded once per process. Raises
    DraftModelError saying what to do when it is not one, or when it has a tokenizer and that is not
    `tokenizer()` (the target model's, asked for only then)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(path).expanduser()
    key = str(directory.resolve())
    with _loading:
        if key in _loaded:
            return _loaded[key]
        if not (directory / "config.json").is_file():
            raise DraftModelError(
                f"draft model {path!r}: no config.json there; give the directory of a small "
                "local checkpoint with this model's tokenizer (--speculate draft:PATH)"
            )
        if any(directory.glob("tokenizer*")):
            theirs = AutoTokenizer.from_pretrained(key, local_files_only=True)
            if theirs.get_vocab() != tokenizer().get_vocab():
                raise DraftModelError(
                    f"draft model {path!r} has another tokenizer than the model it drafts for: "
                    "its tokens would mean other text; pick a checkpoint of the same family"
                )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                key, local_files_only=True, dtype=torch.float32
            )
        except (OSError, ValueError, KeyError) as e:
            raise DraftModelError(f"draft model {path!r} could not be loaded: {e}") from e
        model.eval()
        _loaded[key] = model
        return model
