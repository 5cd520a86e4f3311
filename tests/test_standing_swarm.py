"""Standing end to end in one process (tests/memnet.py): servers fed from their swarm views
(peerd.daemon.contributions) grant a peer that serves blocks of the model a standing, tell it in
every session_opened, and a client that only takes gets none; `peerd status` reports both sides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import blocks
from peerd.daemon.contributions import Contradictions, contributor_share, look, standing_seen
from peerd.session.inference import InferenceSession
from peerd.session.swarm import SwarmView
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, open_memnet, save_tiny_llama

HIDDEN = 32


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("memnet"))


def _view(net: MemNet, name: str, servers: list[str]) -> SwarmView:
    view = SwarmView(net.node(name), TINY_MODEL, TINY_BLOCKS, refresh_period=60)
    view.records = net.records(servers)
    return view


async def _generate(view: SwarmView) -> None:
    async with InferenceSession(view, max_length=16) as session:
        await session.step(torch.randn(1, 4, HIDDEN))
        await session.step(torch.randn(1, 1, HIDDEN))


async def test_a_peer_that_serves_gets_standing_in_every_session_and_a_taker_none(
    tiny_llama: Path,
) -> None:
    async with open_memnet() as net:
        for name, (start, end) in {"a": (0, 3), "b": (3, 6), "volunteer": (0, 3)}.items():
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        for name in ("a", "b"):
            server = net.server(name)
            server.standing.qualify_s = (
                0  # the stretch qualifies at once (QUALIFY_S is pure-tested)
            )
            look(server.standing, _view(net, name, ["a", "b", "volunteer"]), Contradictions())
        volunteer = _view(net, "volunteer", ["a", "b"])  # its own route: through a and b
        taker = _view(net, "taker", ["a", "b"])
        await _generate(volunteer)
        await _generate(taker)
        granted = net.server("a").standing.of(net.peer_id("volunteer"))
        assert granted > 0
        assert net.server("a").standing.of(net.peer_id("taker")) == 0
        # The servers said so in session_opened, and status shows the median of what they said.
        assert volunteer.standing_seen[net.peer_id("a")][0] == pytest.approx(
            granted, rel=0.2
        )  # decays on the real clock meanwhile
        assert standing_seen(volunteer) == pytest.approx(
            granted, rel=0.2
        )  # decays on the real clock meanwhile
        assert standing_seen(taker) == 0
        # Server a ran both: the volunteer's tokens went to a contributor.
        share = contributor_share(net.server("a"))
        assert 0 < share < 1
