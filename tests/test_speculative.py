"""Speculative decoding (peerd.session.speculative): through three real BlockServers on an
in-memory network (tests/memnet.py), greedy with each drafter gives plain greedy's tokens, for
tiny random models of two families; a middle server killed mid-speculation is replaced without
changing a token; seeded sampling repeats itself; and the first three sampled tokens are
distributed as plain sampling's (chi-square over 2,000 seeded runs on one local span).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import blocks
import wire
from peerd.session.drafting import Draft, lookup
from peerd.session.generation import Generator
from peerd.session.inference import InferenceSession
from peerd.session.speculative import (
    Adaptive,
    Fixed,
    PassCost,
    Speculation,
    SpeculativeDecoder,
    Tally,
    parse_speculate,
)
from peerd.session.swarm import SwarmView
from tests.memnet import MemNet, open_memnet
from tests.tiny_models import save_tiny

# Two families whose random weights fall into repeats now and then from PROMPT (so prompt
# lookup's drafts both stand and fall): rotary (qwen3) and ALiBi (bloom) positions.
FAMILIES = ("qwen3", "bloom")
NEW_TOKENS = 24
# Repetitive, so prompt lookup finds matches; the random models continue it their own way.
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("speculative")
    return {name: save_tiny(name, root / name) for name in FAMILIES}


def _layers(path: Path) -> int:
    return blocks.load_client_side(path).config.num_hidden_layers  # type: ignore[no-any-return]


def _serve_thirds(net: MemNet, path: Path, model: str) -> SwarmView:
    layers = _layers(path)
    cuts = [0, layers // 3, 2 * layers // 3, layers]
    for name, start, end in zip("abc", cuts, cuts[1:], strict=False):
        net.serve(name, blocks.load_span(path, start, end), model=model)
    view = SwarmView(net.node("client"), model, layers, refresh_period=60)  # type: ignore[arg-type]
    view.records = net.records()
    return view


async def _tokens(
    generator: Generator,
    speculate: Speculation | None,
    params: wire.Sampling | None = None,
    tally: Tally | None = None,
) -> list[int]:
    prompt = torch.tensor([PROMPT])
    stream = generator.generate(prompt, NEW_TOKENS, params, speculate=speculate, tally=tally)
    return [int(t[0, 0]) async for t in stream]


@pytest.mark.parametrize("family", FAMILIES)
async def test_greedy_with_every_drafter_equals_plain_greedy(
    tiny: dict[str, Path], family: str
) -> None:
    path = tiny[family]
    async with open_memnet() as net:
        generator = Generator(blocks.load_client_side(path), _serve_thirds(net, path, family))
        plain = await _tokens(generator, None)
        tallies = {}
        for speculate in ("ngram", "auto", f"draft:{path}"):
            tallies[speculate] = Tally()
            got = await _tokens(generator, parse_speculate(speculate), tally=tallies[speculate])
            assert got == plain, speculate
        # A draft model of the same weights guesses right every time: whole passes stand.
        assert await _tokens(generator, parse_speculate(f"draft:{path}", 5)) == plain
        # Seeded sampling repeats itself, drafts and all: prompt lookup's drafts take plain
        # sampling's draws, so however many drafts a pass carries (auto's k follows timings)
        # the text is plain seeded sampling's.
        seeded = wire.Sampling(do_sample=True, seed=11)
        sampled = await _tokens(generator, None, seeded)
        for speculation in ("ngram", 1), ("ngram", 3), ("ngram", 8), ("auto", None):
            got = await _tokens(generator, parse_speculate(*speculation), seeded)
            assert got == sampled, speculation
    ngram = tallies["ngram"]
    # Drafts stood and drafts fell (the servers' caches rolled back), and passes were saved.
    assert 0 < ngram.accepted < ngram.drafted, ngram
    assert ngram.passes < NEW_TOKENS
    drafted = tallies[f"draft:{path}"]
    assert drafted.accepted == drafted.drafted > 0, drafted
    assert len(plain) == NEW_TOKENS


async def _stopped_then_continued(
    generator: Generator, view: SwarmView, speculate: Speculation | None, stop_at: int
) -> list[int]:
    """A generation its reader stops after `stop_at` tokens (mid-pass, when a pass carried
    more), then a next turn of the same session."""
    tokens: list[int] = []
    async with InferenceSession(view, max_length=len(PROMPT) + 2 * NEW_TOKENS) as session:
        stream = generator.generate(
            torch.tensor([PROMPT]), NEW_TOKENS, session=session, speculate=speculate
        )
        async with contextlib.aclosing(stream):
            async for token in stream:
                tokens.append(int(token[0, 0]))
                if len(tokens) == stop_at:
                    break
        # As after plain decoding: every token but the last one read went through the blocks.
        assert session.position == len(PROMPT) + stop_at - 1
        again = generator.generate(torch.tensor([PROMPT[:4]]), 8, session=session)
        tokens += [int(t[0, 0]) async for t in again]
    return tokens


async def test_a_reader_stopping_mid_pass_leaves_the_caches_at_its_last_token(
    tiny: dict[str, Path],
) -> None:
    path = tiny["bloom"]
    async with open_memnet() as net:
        view = _serve_thirds(net, path, "bloom")
        generator = Generator(blocks.load_client_side(path), view)
        for stop_at in (3, 6, 9):
            plain = await _stopped_then_continued(generator, view, None, stop_at)
            spec = parse_speculate("ngram", 6)
            assert await _stopped_then_continued(generator, view, spec, stop_at) == plain


async def test_a_killed_middle_server_mid_speculation_changes_no_token(
    tiny: dict[str, Path],
) -> None:
    path = tiny["bloom"]
    async with open_memnet() as net:
        view = _serve_thirds(net, path, "bloom")
        net.serve("b2", blocks.load_span(path, 1, 2), model="bloom")  # b's understudy
        view.records = net.records()
        generator = Generator(blocks.load_client_side(path), view)
        plain = await _tokens(generator, None)
        spec = parse_speculate("ngram", 4)
        async with InferenceSession(view, max_length=len(PROMPT) + NEW_TOKENS) as session:
            middle = session.route[1].peer_id
            victim = next(n for n in ("b", "b2") if net.peer_id(n) == middle)
            got: list[int] = []
            stream = generator.generate(
                torch.tensor([PROMPT]), NEW_TOKENS, speculate=spec, session=session
            )
            async for token in stream:
                got.append(int(token[0, 0]))
                if len(got) == 6:
                    net.kill(victim)
            assert session.failures == 1
    assert got == plain


class _LocalChain:
    """Every block in one span with its own cache, in this process: the chain of a 1-hop swarm
    without the network, for runs too many to send through servers."""

    def __init__(self, span: blocks.Span, max_length: int) -> None:
        self.span = span
        self.max_length = max_length
        self.cache = blocks.MemoryCache(budget_tokens=max_length).open_session(1, max_length)

    @property
    def position(self) -> int:
        return self.cache.position

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.span(hidden, self.cache)

    def rollback(self, position: int) -> None:
        self.cache.rollback(position)


RUNS = 2000
SAMPLED = 3
TOP_K = 3  # 27 possible first three tokens: enough runs land in each to count them


class _FixedDraft:
    """A drafter that samples every draft from one fixed distribution `q` (the acceptance rule
    must give plain sampling's distribution whatever q is; one near p makes drafts both stand
    and fall, and costs no model run, so 2,000 runs take seconds)."""

    cheap = True

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q

    def propose(
        self, sequence: Any, k: int, params: wire.Sampling, generator: torch.Generator
    ) -> Draft:
        tokens = torch.multinomial(self.q, k, replacement=True, generator=generator)
        return Draft(tokens.tolist(), self.q.expand(k, -1))


def _exact_distribution(
    span: blocks.Span, client: blocks.ClientSide, params: wire.Sampling
) -> dict[tuple[int, ...], float]:
    """P(first SAMPLED tokens) of plain sampling, by enumerating every path of top-k tokens."""
    from peerd.session.sampling import logits_to_probs

    paths: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(SAMPLED):
            longer: dict[tuple[int, ...], float] = {}
            for path, p in paths.items():
                hidden = span(client.embed(torch.tensor([PROMPT + list(path)])))
                probs = logits_to_probs(client.logits(hidden[:, -1]).float(), params)[0]
                for token in torch.nonzero(probs).flatten().tolist():
                    longer[(*path, token)] = p * float(probs[token])
            paths = longer
    return paths


async def test_sampled_tokens_are_distributed_as_plain_sampling(
    tiny: dict[str, Path],
) -> None:
    """Chi-square of the first three tokens of 2,000 seeded speculative runs (3 drafts a pass,
    drawn from a distribution near the target's) against plain sampling's exact distribution."""
    path = tiny["qwen3"]
    # One block is model enough for the statistics, and runs 2,000 times in seconds.
    span = blocks.load_span(path, 0, 1)
    client = blocks.load_client_side(path)
    params = wire.Sampling(do_sample=True, top_k=TOP_K)
    expected = _exact_distribution(span, client, params)
    # Drafts from the tokens any of the paths takes, uniformly: near p, but not p.
    q = torch.zeros(client.embeddings.num_embeddings)
    q[sorted({token for path in expected for token in path})] = 1.0
    counts: Counter[tuple[int, ...]] = Counter()
    tally = Tally()
    # The prompt but its last token runs once; each run goes on from there (its rollbacks
    # never reach below), so a run costs only its own one or two passes.
    chain = _LocalChain(span, len(PROMPT) + SAMPLED)
    await chain.step(client.embed(torch.tensor([PROMPT[:-1]])))
    for seed in range(RUNS):
        decoder = SpeculativeDecoder(
            client.embed,
            client.logits,
            _FixedDraft(q / q.sum()),
            Fixed(3),
            params,
            torch.Generator().manual_seed(seed),
            tally,
        )
        chain.rollback(len(PROMPT) - 1)
        stream = decoder.decode(chain, torch.tensor([PROMPT[-1:]]), SAMPLED, ())
        counts[tuple([int(t[0, 0]) async for t in stream])] += 1
    assert 0 < tally.accepted < tally.drafted, tally  # both rules of acceptance ran
    assert set(counts) <= set(expected)
    statistic = sum((counts[k] - RUNS * p) ** 2 / (RUNS * p) for k, p in expected.items())
    freedom = len(expected) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(freedom / 2), torch.tensor(statistic / 2)))
    assert p_value > 0.01, (p_value, counts)


def test_the_client_library_and_the_model_speculate_to_plain_greedys_tokens(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    """Through a real LocalApi on a Unix socket (three BlockServers behind it): every
    `speculate` of Client.generate, and generate(prompt_lookup_num_tokens=...) /
    generate(assistant_model=...) of AutoDistributedModelForCausalLM, give transformers'
    greedy tokens; a bad drafter is refused with what to do."""
    from transformers import AutoModelForCausalLM

    from peerd.sdk.client import Client, PeerdError
    from peerd.sdk.model import AutoDistributedModelForCausalLM
    from tests.test_family_features import InProcessDaemon

    path = tiny["qwen3"]
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPT])
    expected = local.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    new = expected[0, len(PROMPT) :].tolist()
    with InProcessDaemon(path, tmp_path / "peerd.sock", []) as daemon:
        model = AutoDistributedModelForCausalLM.from_pretrained(path, socket=daemon.socket)
        try:
            for keywords in ({"prompt_lookup_num_tokens": 4}, {"assistant_model": local}):
                got = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **keywords)
                assert got.tolist() == expected.tolist(), keywords
        finally:
            model.close()
        with Client(daemon.socket) as client:
            for speculate in ("off", "auto", "ngram", f"draft:{path}"):
                result = client.generate_full(
                    input_ids=PROMPT, max_new_tokens=NEW_TOKENS, speculate=speculate
                )
                assert result.token_ids == new, speculate
            for bad, says in (("sometimes", "give auto, ngram"), ("draft:/nowhere", "config")):
                with pytest.raises(PeerdError, match=says):
                    client.generate_full(input_ids=PROMPT, max_new_tokens=2, speculate=bad)
            # Turns of one session (the daemon's chat path) speculate like single generations.
            turns = {speculate: _two_turns(client, speculate) for speculate in ("off", "ngram")}
            assert turns["ngram"] == turns["off"]


def _two_turns(client: Any, speculate: str) -> list[list[int]]:
    session = client.open_session(len(PROMPT) + 2 * NEW_TOKENS)
    try:
        first = client.generate_full(
            input_ids=PROMPT, max_new_tokens=5, session=session, speculate=speculate
        )
        second = client.generate_full(
            input_ids=PROMPT[:4], max_new_tokens=NEW_TOKENS, session=session, speculate=speculate
        )
    finally:
        client.close_session(session)
    return [first.token_ids, second.token_ids]


def test_the_gateway_takes_speculate_but_never_a_draft_model_path() -> None:
    """The web APIs pass `speculate` on (auto by default); a draft model's path is the daemon
    operator's choice, so a request naming one is refused."""
    import pydantic

    from peerd.gateway.openai_api import CompletionRequest
    from peerd.gateway.petals import V1Request

    assert V1Request(inputs="hi").sampling(4).speculate == "auto"
    assert V1Request(inputs="hi", speculate="off").sampling(4).speculate == "off"
    assert CompletionRequest(prompt="hi", speculate="ngram").sampling(4).speculate == "ngram"
    for bad in ({"inputs": "hi", "speculate": "draft:/etc"}, {"inputs": "hi", "speculate": 3}):
        with pytest.raises(pydantic.ValidationError):
            V1Request(**bad)
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest(prompt="hi", speculate="draft:/home/someone/model")


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # latest 3-gram match
    assert lookup([4, 5, 6, 4, 5], 3) == [6, 4, 5]
    assert lookup([4, 5, 6, 7, 5], 3) == [6, 7, 5]  # a one-token match, when nothing longer
    assert lookup([4, 5, 6, 7, 8], 3) == []
    assert lookup([1, 2], 4) == [] and lookup([1, 2, 1, 2], 0) == []


def test_auto_drafts_where_it_pays_and_turns_itself_off_where_it_does_not() -> None:
    """Passes timed as a chain whose latency dwarfs a token's compute (a WAN): with drafts that
    mostly stand, auto drafts many a pass; once they mostly fall, none (but for its probes).
    Where every extra token costs as much as a pass (a slow server), none either."""
    wan, slow = Adaptive(), Adaptive()
    for k, accepted in [(4, 4), (2, 2), (6, 5), (3, 3), (5, 5), (1, 1)] * 4:
        for policy, per_token in ((wan, 0.002), (slow, 0.1)):
            policy.record(k + 1, k, accepted, 0.1 + per_token * k)
    assert wan.k() == wan.max_k and slow.k() == 0
    for _ in range(30):
        wan.record(4, 3, 0, 0.1 + 0.002 * 3)
    assert [wan.k() for _ in range(16)].count(0) == 15  # off, probing once in 16 passes


def test_pass_cost_has_a_step_from_one_token_to_several() -> None:
    """One-token passes are timed apart from longer ones: on a CPU server a pass of a few drafts
    costs a step above a one-token pass, and each draft more little (the spec bench's timings)."""
    cost = PassCost()
    for tokens, seconds in [(1, 0.21), (1, 0.22), (5, 0.29), (9, 0.32), (1, 0.20), (5, 0.29)]:
        cost.add(tokens, seconds)
    costs = cost.fit()
    assert costs is not None
    assert costs.seconds(1) == pytest.approx(0.21)
    assert costs.seconds(5) == pytest.approx(0.2925, rel=0.01)  # mean of the 5-token passes
    assert costs.seconds(9) == pytest.approx(0.32, rel=0.05)
    assert costs.seconds(2) > costs.seconds(1) * 1.2  # the step
    assert costs.seconds(13) - costs.seconds(9) < 0.05


def test_auto_drafts_long_runs_where_drafts_that_start_well_go_on_standing() -> None:
    """A rewrite: half of the passes' first drafts fall, but once one stands the copied run
    mostly stands whole. One rate for every draft (0.81 here) kept k at 5 of 12; with the
    rate after a standing draft apart, auto drafts the most it may. Open text whose first drafts
    mostly fall and whose runs break at once: off."""
    rewrite, chat = Adaptive(), Adaptive()
    for _ in range(6):
        for policy in (rewrite, chat):
            policy.record(1, 0, 0, 0.21)
    for drafts, accepted in [(8, 8), (8, 0), (8, 7), (8, 0)] * 6:
        rewrite.record(drafts + 1, drafts, accepted, 0.26 + 0.008 * drafts)
    for drafts, accepted in [(2, 1), (2, 0), (1, 0), (2, 0), (1, 0)] * 5:
        chat.record(drafts + 1, drafts, accepted, 0.26 + 0.008 * drafts)
    assert rewrite.k() == rewrite.max_k
    assert chat.k() == 0
