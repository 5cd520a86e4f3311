"""Speculative decoding (peerd.session.speculative): through three real BlockServers on an
in-memory network (tests/memnet.py), greedy with each drafter gives plain greedy's tokens, for
tiny random models of two families; a middle server killed mid-speculation is replaced without
changing a token; seeded sampling repeats itself; and the first three sampled tokens are
distributed as plain sampling's (chi-square over 2,000 seeded runs on one local span).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import blocks
import wire
from peerd.session.drafting import lookup
from peerd.session.generation import Generator
from peerd.session.inference import InferenceSession
from peerd.session.speculative import Adaptive, Speculation, Tally, parse_speculate
from peerd.session.swarm import SwarmView
from tests.memnet import MemNet, open_memnet
from tests.tiny_models import TINY_CONFIGS, save_tiny

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
    ngram = tallies["ngram"]
    # Drafts stood and drafts fell (the servers' caches rolled back), and passes were saved.
    assert 0 < ngram.accepted < ngram.drafted, ngram
    assert ngram.passes < NEW_TOKENS
    drafted = tallies[f"draft:{path}"]
    assert drafted.accepted == drafted.drafted > 0, drafted
    assert len(plain) == NEW_TOKENS


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
