"""Speculative decoding through real `peerd start` daemons of the default model (separate
processes on 127.0.0.1) and a leeching client in the test process: prompt lookup gives
transformers' greedy tokens, a kill -9 of the middle server mid-speculation included. (Every
drafter, auto included, is held to plain greedy on tiny models in tests/test_speculative.py;
one run here keeps the daemons' CI time down.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from peerd.devtools.localswarm import LocalSwarm
from peerd.session.inference import InferenceSession
from peerd.session.leech import open_leech
from peerd.session.speculative import Tally, parse_speculate
from tests.conftest import greedy_continuation

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# The model continues by copying: prompt lookup's drafts mostly stand, some fall.
PROMPT = (
    "Copy the list: red apple, green pear, yellow banana, purple plum, orange mango.\n"
    "Copy: red apple, green pear, yellow banana, purple plum, orange mango.\nCopy: red apple,"
)
NEW_TOKENS = 24
KILL_AT = 8


async def test_greedy_through_daemons_with_a_killed_middle_server_mid_speculation(
    local_model: Any, tokenizer: Any
) -> None:
    reference = greedy_continuation(local_model, tokenizer, PROMPT, NEW_TOKENS)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    swarm = LocalSwarm()
    try:
        swarm.start("a", "0:10")
        middles = [swarm.start("b1", "10:20"), swarm.start("b2", "10:20")]
        swarm.start("c", "20:30")
        async with open_leech("default", swarm.initial_peers, refresh_period=2.0) as leech:
            tally = Tally()
            tokens: list[int] = []
            async with InferenceSession(leech.swarm, max_length=ids.shape[1] + NEW_TOKENS) as s:
                stream = leech.generator.generate(
                    ids, NEW_TOKENS, session=s, speculate=parse_speculate("ngram", 4), tally=tally
                )
                async for token in stream:
                    tokens.append(int(token[0, 0]))
                    if len(tokens) == KILL_AT:
                        victim = next(h.peer_id for h in s.hops if h.hop.start == 10)
                        next(m for m in middles if m.peer_id == victim).kill()
                assert s.failures == 1
        assert tokens == reference
        assert tally.passes < NEW_TOKENS  # drafts stood: passes carried several tokens
    finally:
        swarm.stop()
