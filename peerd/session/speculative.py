"""Speculative decoding through the swarm: the client proposes a few tokens (a drafter of
peerd.session.drafting) and the swarm checks them in one pass, so one chain latency can yield
several tokens.

One pass sends the token not yet in the servers' caches plus k drafts as one multi-token step
(through the push chain like any step). The logits of its k+1 positions decide, left to right,
which drafts stand: greedy keeps a draft while it is the argmax, so the output is plain greedy's
token for token; sampling keeps draft d with probability min(1, p(d)/q(d)) and else samples the
residual max(p - q, 0) (Leviathan et al. 2023, Chen et al. 2023), so the tokens are distributed
as plain sampling's; every random draw comes from the generation's seeded generator. A rejected
draft's keys and values stay in the servers' caches until the next step, whose start position
rolls every hop back (InferenceSession.rollback: no extra round trip).

`auto` (Adaptive) picks k each pass from the measured acceptance rates (of a pass's first draft,
and of a draft after one that stood) and the measured cost of a pass of so many tokens, and
drafts nothing while speculation would not pay, probing now and then in case the text turned
repetitive.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from peerd.node import compute_thread
from peerd.session.drafting import Draft, Drafter
from peerd.session.sampling import SamplingParams, apply_repetition_penalty, logits_to_probs

Mode = Literal["off", "auto", "ngram", "draft"]
# Most drafts in one pass: k + 1 tokens stay within what a server merges with other sessions'
# short steps (peerd.server.batching.MERGE_MAX_TOKENS), and a longer guess rarely all stands.
MAX_DRAFT_TOKENS = 15
DEFAULT_TOKENS = {"ngram": 8, "draft": 4, "auto": 12}


@dataclass(frozen=True)
class Speculation:
    """What a request asked for: `--speculate auto|ngram|draft:PATH|off` and, optionally, a
    fixed number of drafts per pass (prompt_lookup_num_tokens / num_assistant_tokens)."""

    mode: Mode = "off"
    draft_path: str | None = None
    num_tokens: int | None = None

    @property
    def on(self) -> bool:
        return self.mode != "off"


def parse_speculate(text: str, num_tokens: int | None = None) -> Speculation:
    """`auto`, `ngram`, `draft:PATH` or `off` (ValueError saying which are allowed)."""
    if num_tokens is not None and not 1 <= num_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"the number of draft tokens must be 1..{MAX_DRAFT_TOKENS}")
    if text.startswith("draft:") and len(text) > len("draft:"):
        return Speculation("draft", text[len("draft:") :], num_tokens)
    if text in ("off", "auto", "ngram"):
        return Speculation(text, None, num_tokens)  # type: ignore[arg-type]
    raise ValueError(
        f"speculate {text!r}: give auto, ngram, draft:PATH (a local checkpoint) or off"
    )


class Policy(Protocol):
    """How many drafts the next pass carries, and what it learns from each pass."""

    def k(self) -> int: ...

    def record(self, tokens: int, drafts: int, accepted: int, seconds: float | None) -> None: ...


@dataclass
class Fixed:
    """Always ask for the same number of drafts (`ngram`, `draft:PATH`)."""

    tokens: int
    passes: int = 0
    accepted: int = 0

    def k(self) -> int:
        return self.tokens

    def record(self, tokens: int, drafts: int, accepted: int, seconds: float | None) -> None:
        self.passes += 1
        self.accepted += accepted


# How fast Adaptive forgets its acceptance rates: the weight of the last pass.
DECAY = 0.1
# While off, one pass in this many drafts a single token to see whether the text changed.
PROBE_EVERY = 16
# Passes whose timing the cost model is fitted to (the latest ones of each kind).
COST_WINDOW = 24
# Until passes of several tokens were timed, an extra token is taken to cost this fraction of a
# one-token pass: about what a forward of a few more tokens costs a CPU server (a GPU's is less;
# the fit finds out). Once passes of one length were timed, but not of several lengths, each
# token beyond the second adds PRIOR_SLOPE of a one-token pass.
PRIOR_TOKEN_COST = 0.15
PRIOR_SLOPE = 0.03
# Drafting must promise this much more speed than a plain pass before auto drafts: where it
# would barely pay, timing noise and the wasted compute of fallen drafts make it a loss.
MARGIN = 1.1


@dataclass(frozen=True)
class Costs:
    """Seconds of a pass of m tokens: `one` for m = 1, else `latency + per_token * (m - 1)`.
    Two pieces, because a CPU server's forward of 2 rows costs ~1.7x one row's and of 8 rows
    only ~2.6x (its matrix kernels switch from vector to blocked form): a pass of a few drafts
    costs a step above a one-token pass, and each draft more little (the spec bench's WAN:
    0.21 s for 1 token, 0.28 s for 4, 0.32 s for 9)."""

    one: float
    latency: float
    per_token: float

    def seconds(self, tokens: int) -> float:
        if tokens <= 1:
            return self.one
        return max(self.latency + self.per_token * (tokens - 1), self.one)


@dataclass
class PassCost:
    """The latest passes' timings: one-token passes by their median, longer ones by a
    least-squares line (Costs)."""

    single: deque[float] = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    multi: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=COST_WINDOW))

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 1:
            self.single.append(seconds)
        else:
            self.multi.append((tokens, seconds))

    def fit(self) -> Costs | None:
        """None before any pass was timed."""
        one = statistics.median(self.single) if self.single else None
        if not self.multi:
            return None if one is None else Costs(one, one, PRIOR_TOKEN_COST * one)
        n = len(self.multi)
        mean_m = sum(m for m, _ in self.multi) / n
        mean_t = sum(t for _, t in self.multi) / n
        var_m = sum((m - mean_m) ** 2 for m, _ in self.multi) / n
        # What a one-token pass would cost by the prior, when none was timed.
        prior_one = mean_t / (1 + PRIOR_TOKEN_COST * (mean_m - 1))
        per_token = PRIOR_SLOPE * (one or prior_one)
        if var_m >= 1.0:
            cov = sum((m - mean_m) * (t - mean_t) for m, t in self.multi) / n
            per_token = min(max(cov / var_m, 0.0), mean_t)
        latency = mean_t - per_token * (mean_m - 1)
        if latency <= 0:
            latency, per_token = prior_one, PRIOR_TOKEN_COST * prior_one
        return Costs(one if one is not None else latency, latency, per_token)


@dataclass
class Adaptive:
    """`auto`: the k that maximises expected tokens per second of a pass, E(k) / T(k + 1), with
    E(k) = 1 + a * (1 + b + ... + b^(k - 1)) for the rate a at which a pass's first draft
    stands and the rate b at which a draft stands once the one before it did (in a rewrite a
    copied run, once found, mostly stands whole: b >> a), and T the pass cost fitted to the
    passes timed so far (PassCost); k = 0 (speculation off) unless that beats a plain pass by
    MARGIN."""

    max_k: int = DEFAULT_TOKENS["auto"]
    first: float = 1.0  # a prior of one first draft in three standing...
    first_trials: float = 3.0
    then: float = 2.0  # ...and of two in three of the drafts after one that stood
    then_trials: float = 3.0
    cost: PassCost = field(default_factory=PassCost)
    off_passes: int = 0
    passes: int = 0
    accepted: int = 0

    @property
    def rates(self) -> tuple[float, float]:
        """(a, b): how often a first draft stands, and a draft after one that stood."""
        return (
            min(self.first / self.first_trials, 0.999),
            min(self.then / self.then_trials, 0.999),
        )

    def k(self) -> int:
        best = self._best()
        if best == 0:
            self.off_passes += 1
            if self.off_passes % PROBE_EVERY == 0:
                return 1
        return best

    def _best(self) -> int:
        costs = self.cost.fit()
        if costs is None:
            return max(1, self.max_k // 2)  # no timing yet: the first passes find out
        a, b = self.rates

        def speed(k: int) -> float:
            return expected_tokens(a, b, k) / costs.seconds(k + 1)

        best = max(range(1, self.max_k + 1), key=speed)
        return best if speed(best) >= MARGIN / costs.one else 0

    def record(self, tokens: int, drafts: int, accepted: int, seconds: float | None) -> None:
        self.passes += 1
        self.accepted += accepted
        if drafts:
            self.first = (1 - DECAY) * self.first + (1 if accepted else 0)
            self.first_trials = (1 - DECAY) * self.first_trials + 1
            if accepted and drafts > 1:
                # Drafts 2.. were tried while the one before stood: all but the last stood.
                tried = accepted if accepted < drafts else drafts - 1
                self.then = (1 - DECAY) * self.then + accepted - 1
                self.then_trials = (1 - DECAY) * self.then_trials + tried
        if seconds is not None:
            self.cost.add(tokens, seconds)


def expected_tokens(first: float, then: float, k: int) -> float:
    """Tokens one pass with k drafts yields on average when its first draft stands with
    probability `first` and each later one with probability `then` once the one before it did
    (the pass's own token included)."""
    return 1 + first * sum(then**i for i in range(k))


def policy_for(speculation: Speculation) -> Policy:
    if speculation.mode == "auto":
        return Adaptive(max_k=speculation.num_tokens or DEFAULT_TOKENS["auto"])
    return Fixed(speculation.num_tokens or DEFAULT_TOKENS[speculation.mode])


def verify(
    logits: torch.Tensor,
    sequence: Sequence[int],
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator,
) -> tuple[int, int]:
    """(how many drafts stand, the token after them). `logits` [len(draft) + 1, vocab]: row i
    predicts the token after `sequence` + the first i drafts."""
    drafts = draft.tokens
    for i in range(len(drafts) + 1):
        row = logits[i : i + 1].float()
        if params.repetition_penalty != 1.0:  # the sequence as it stands at this position
            ids = torch.tensor([list(sequence) + drafts[:i]])
            row = apply_repetition_penalty(row, ids, params.repetition_penalty)
        if not params.do_sample:
            best = int(row.argmax())
            if i < len(drafts) and best == drafts[i]:
                continue
            return i, best
        p = logits_to_probs(row, params)[0]
        if i == len(drafts) or draft.probs is None:
            # The token plain sampling draws here, from the same generator. A draft chosen
            # deterministically (a point mass q at d) stands iff it is that token: probability
            # p(d) = min(1, p(d)/q(d)), and a rejection leaves p without d, which is the
            # residual max(p - q, 0) normalised. So the rule is the standard one, and the draws
            # are plain sampling's, one per token in order: a seeded run gives the same text
            # whatever k `auto` chose (k follows timings, which vary run to run).
            token = int(torch.multinomial(p, 1, generator=generator))
            if i < len(drafts) and token == drafts[i]:
                continue
            return i, token
        token = drafts[i]
        q = draft.probs[i].to(p.dtype)
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any rejection is noise
            residual = p
        return i, int(torch.multinomial(residual, 1, generator=generator))
    raise AssertionError("unreachable: the last row always returns")


def _one_sequence(input_ids: torch.Tensor) -> list[int]:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        shape = list(input_ids.shape)
        raise ValueError(f"speculative decoding takes ids of shape [1, tokens], got {shape}")
    return [int(t) for t in input_ids[0]]


class Chain(Protocol):
    """What speculative decoding needs of an inference session (InferenceSession has it)."""

    position: int
    max_length: int

    async def step(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def rollback(self, position: int) -> None: ...


@dataclass
class Tally:
    """What one speculative generation did: passes through the swarm, drafts sent and drafts
    that stood (tokens / passes is the tokens each chain latency bought)."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0


@dataclass
class SpeculativeDecoder:
    """Decodes one sequence (batch of one) with drafts checked by `chain` a pass at a time."""

    embed: Callable[[torch.Tensor], torch.Tensor]  # [1, tokens] ids -> [1, tokens, hidden]
    logits: Callable[[torch.Tensor], torch.Tensor]  # [rows, hidden] -> [rows, vocab] (a thread)
    drafter: Drafter
    policy: Policy
    params: SamplingParams
    generator: torch.Generator
    tally: Tally = field(default_factory=Tally)

    async def decode(
        self,
        chain: Chain,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
    ) -> AsyncGenerator[torch.Tensor, None]:
        """Yield [1, 1] token ids as plain decoding would. The chain holds, whenever this is
        suspended at a yield or has finished, every token before the last one yielded (the
        drafts past it are rolled back), as after plain decoding."""
        sequence = _one_sequence(input_ids)
        pending = list(sequence)  # tokens not in the servers' caches yet
        produced = 0
        consistent: int | None = None
        try:
            while produced < max_new_tokens:
                start = chain.position
                room = chain.max_length - start - len(pending)
                k = max(0, min(self.policy.k(), max_new_tokens - produced - 1, room))
                draft = await self._draft(sequence, k)
                step = pending + draft.tokens
                sent = time.perf_counter()
                hidden = await chain.step(self.embed(torch.tensor([step])))
                seconds = time.perf_counter() - sent
                rows = hidden[0, len(pending) - 1 :]
                accepted, token = await compute_thread.run(self._verify, rows, sequence, draft)
                # The prompt's pass is no measure of a decode pass's cost.
                timed = seconds if produced > 0 else None
                self.policy.record(len(step), len(draft.tokens), accepted, timed)
                self.tally.passes += 1
                self.tally.drafted += len(draft.tokens)
                self.tally.accepted += accepted
                if accepted < len(draft.tokens):
                    chain.rollback(start + len(pending) + accepted)
                for i, new in enumerate([*draft.tokens[:accepted], token]):
                    consistent = start + len(pending) + i
                    produced += 1
                    self.tally.tokens += 1
                    sequence.append(new)
                    yield torch.tensor([[new]])
                    if new in eos_token_ids or produced >= max_new_tokens:
                        return
                pending = [token]
        finally:
            if consistent is not None and chain.position > consistent:
                chain.rollback(consistent)

    async def _draft(self, sequence: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        args = (list(sequence), k, self.params, self.generator)
        if getattr(self.drafter, "cheap", False):  # microseconds: less than a hand-off costs
            return self.drafter.propose(*args)
        return await compute_thread.run(self.drafter.propose, *args)

    def _verify(self, rows: torch.Tensor, sequence: list[int], draft: Draft) -> tuple[int, int]:
        with torch.inference_mode():
            logits = self.logits(rows)
        return verify(logits, sequence, draft, self.params, self.generator)
