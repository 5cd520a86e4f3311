"""Spot checks of servers' results (peerd.session.verify): the tolerance tells honest codec and
fp32 noise
from corruption, and a real server started with the test-only PEERD_TEST_CORRUPT flag is caught,
banned and routed around while the generation's text stays the honest one."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

import wire
from peerd.devtools.localswarm import LocalSwarm
from peerd.server.block_server import TEST_CORRUPT_ENV, _corrupted
from peerd.session.inference import InferenceSession
from peerd.session.leech import open_leech
from peerd.session.verify import excess
from tests.conftest import greedy_continuation

PROMPT = "Once upon a time, there was a little"


def _hidden_like_the_model(seed: int) -> torch.Tensor:
    """[1, 6, 576] with the model's shape of values: mostly O(1), a few dims in the hundreds."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 6, 576, generator=g)
    hidden[..., 17] *= 400.0
    return hidden


@pytest.mark.parametrize("codec", ["raw", "float16", "bfloat16", "int8-blockwise"])
def test_honest_results_pass_and_corrupted_ones_fail(codec: wire.Compression) -> None:
    expected = _hidden_like_the_model(0)
    # What an honest server's result looks like after the wire: the codec's rounding, plus
    # fp32 recomputation noise of ~2e-6 of each token's largest value (measured).
    honest = wire.decode_tensor(wire.encode_tensor(expected, codec))
    honest = honest + 2e-6 * expected.abs().amax(-1, keepdim=True) * torch.randn_like(expected)
    received = wire.decode_tensor(wire.encode_tensor(expected, codec))
    assert excess(received, honest, codec) <= 0
    torch.manual_seed(1)
    lied = wire.decode_tensor(wire.encode_tensor(_corrupted(expected), codec))
    assert excess(received, lied, codec) > 0
    one_token_lied = honest.clone()
    one_token_lied[0, 3, 5] += 1.0  # one value of one token, in a dim whose values are O(1)
    assert excess(received, one_token_lied, "raw") > 0 or codec != "raw"


@pytest.mark.slow
@pytest.mark.multiprocess
async def test_a_corrupting_server_is_caught_and_the_text_stays_honest(
    local_model: Any, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    new_tokens = 24
    reference = greedy_continuation(local_model, tokenizer, PROMPT, new_tokens)
    ids = tokenizer(PROMPT)["input_ids"]
    swarm = LocalSwarm()
    try:
        # b holds every block (slowly): it can verify or referee any hop. The liar is the
        # fastest server of 0:10, so routing puts it on the route.
        swarm.start("b", "0:30", "--throughput", "0.5")
        swarm.start("a", "0:10")
        liar = swarm.start("liar", "0:10", "--throughput", "1000", env={TEST_CORRUPT_ENV: "1.0"})
        caplog.set_level(logging.WARNING, logger="peerd.session.verify")
        async with open_leech(
            "default", swarm.initial_peers, refresh_period=2.0, verify_fraction=0.1
        ) as leech:
            assert await leech.swarm.wait_for(lambda snap: len(snap.records) == 3, 60)
            tokens: list[int] = []
            prompt = torch.tensor([ids])
            async with InferenceSession(leech.swarm, max_length=len(ids) + new_tokens) as session:
                assert session.hops[0].peer_id == liar.peer_id, session.describe_route()
                async for token in leech.generator.generate(prompt, new_tokens, session=session):
                    tokens.append(int(token[0, 0]))
                route = [hop.peer_id for hop in session.hops]
                assert session.verifier is not None
                mismatches = session.verifier.mismatches
                checks = session.verifier.checks
            assert leech.swarm.bans.is_liar(liar.peer_id, time.time())
        assert tokens == reference
        assert liar.peer_id not in route
        assert [m.liar for m in mismatches] == [liar.peer_id]
        evidence = mismatches[0]
        assert (evidence.start, evidence.end, evidence.positions) == (0, 10, (0, len(ids)))
        assert evidence.referee is not None and evidence.max_abs_diff > evidence.tolerance
        assert f"{liar.peer_id} returned wrong hidden states for blocks 0:10" in caplog.text
        print(f"{checks} checks over {new_tokens} tokens; evidence: {evidence.describe()}")
    finally:
        swarm.stop()
