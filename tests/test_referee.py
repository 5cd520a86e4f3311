"""The referee of a spot check (peerd.session.verify) runs a hop's whole input history; only the
positions the checked server answered are held against its claim, so a server that lies on a
decode step alone is the one banned, and the honest verifier is not. Against real BlockServers
in one process (tests/memnet.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import trio

import blocks
from peerd.session.inference import InferenceSession
from tests.memnet import open_memnet, random_steps, view_over, whole_output
from tests.numeric import assert_close_scaled

SPANS = {"head": (0, 3), "liar": (3, 6), "honest-1": (3, 6), "honest-2": (3, 6)}


@pytest.mark.parametrize("keep_last", [None, 1])
async def test_a_server_that_lies_on_a_decode_step_alone_is_judged_on_that_step(
    tiny_llama: Path, whole: blocks.Span, keep_last: int | None
) -> None:
    """Honest on the prompt, wrong on the next token: the referee runs the whole history, and
    only its last position is held against the claim (the verifier, honest, stays unbanned)."""
    steps = random_steps(26, (12, 1, 1))
    async with open_memnet() as net:
        for name, (start, end) in SPANS.items():
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        view = view_over(net)
        view.records = net.records(["head", "liar"])
        async with InferenceSession(view, max_length=20, verify_fraction=1.0) as session:
            view.records = net.records()
            with trio.fail_after(30):
                outputs = [await session.step(steps[0], keep_last=keep_last)]
                net.server("liar")._corrupt_fraction = 1.0  # from now on
                outputs += [await session.step(h, keep_last=keep_last) for h in steps[1:]]
            assert session.verifier is not None
            assert [m.liar for m in session.verifier.mismatches] == [net.peer_id("liar")]
            assert session.verifier.mismatches[0].positions == (12, 13)
            assert session.hops[1].peer_id != net.peer_id("liar")
            assert not view.bans.is_liar(net.peer_id("honest-1"), time.time())
            assert not view.bans.is_liar(net.peer_id("honest-2"), time.time())
    expected = whole_output(whole, steps)
    kept = expected[:, [11, 12, 13]] if keep_last else expected
    assert_close_scaled(torch.cat(outputs, dim=1), kept)
