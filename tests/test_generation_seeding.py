"""Sampling's random source: a generation without a seed samples afresh each time, one with a
seed repeats itself. Runs the daemon's Generator over real BlockServers in one process
(tests/memnet.py, tiny random llama)."""

from __future__ import annotations

from pathlib import Path

import torch

import blocks
import wire
from peerd.session.generation import Generator
from peerd.session.swarm import SwarmView
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, open_memnet

NEW_TOKENS = 24


async def _sampled(net: MemNet, generator: Generator, seed: int | None) -> list[int]:
    params = wire.Sampling(do_sample=True, temperature=1.0, seed=seed)
    prompt = torch.tensor([[1, 2, 3, 4]])
    tokens = [t async for t in generator.generate(prompt, NEW_TOKENS, params)]
    return [int(t[0, 0]) for t in tokens]


async def test_unseeded_sampling_differs_and_a_seed_repeats(tiny_llama: Path) -> None:
    async with open_memnet() as net:
        net.serve("head", blocks.load_span(tiny_llama, 0, 3))
        net.serve("tail", blocks.load_span(tiny_llama, 3, TINY_BLOCKS))
        view = SwarmView(net.node("client"), TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]
        view.records = net.records()
        generator = Generator(blocks.load_client_side(tiny_llama), view)
        unseeded = [await _sampled(net, generator, None) for _ in range(3)]
        seeded = [await _sampled(net, generator, 1234) for _ in range(2)]
    assert all(len(tokens) == NEW_TOKENS for tokens in unseeded)
    # Three draws of 24 tokens from a random model's near-flat distribution: equal only if the
    # random source repeats.
    assert len({tuple(tokens) for tokens in unseeded}) == 3, unseeded
    assert seeded[0] == seeded[1]
