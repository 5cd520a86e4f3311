"""The client times the steps real servers run for it (tests/memnet.py), and routes with what it
timed: which hops are timed with push and without, and a server that claims far more than it ran
loses the route it first won."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import blocks
from peerd.session.inference import InferenceSession
from peerd.session.swarm import SwarmView
from routing.planner import plan_route
from routing.speeds import MEASURED_SLACK
from tests.memnet import TINY_BLOCKS, open_memnet, view_over

HIDDEN = 32  # the tiny llama's hidden size
LIE = 1e300


async def _generate(view: SwarmView, *, push: bool, tokens: int = 4) -> list[str]:
    """A prompt and a few decode steps; the peers of the route's hops."""
    async with InferenceSession(view, max_length=16, push=push) as session:
        await session.step(torch.randn(1, 3, HIDDEN))
        for _ in range(tokens):
            await session.step(torch.randn(1, 1, HIDDEN))
        return [hop.peer_id for hop in session.hops]


@pytest.mark.parametrize("push", [True, False])
async def test_the_hops_whose_time_is_their_own_are_timed(tiny_llama: Path, push: bool) -> None:
    async with open_memnet() as net:
        net.serve("head", blocks.load_span(tiny_llama, 0, 3))
        net.serve("tail", blocks.load_span(tiny_llama, 3, TINY_BLOCKS))
        view = view_over(net)
        head, tail = await _generate(view, push=push)
        assert head == net.peer_id("head") and tail == net.peer_id("tail")
        # The first hop always; the second only when we relayed to it ourselves (with push, the
        # head decides when its input arrives).
        assert head in view.speeds and view.speeds[head] > 0
        assert (tail in view.speeds) is (not push)


async def test_a_server_claiming_more_than_it_ran_loses_the_route(tiny_llama: Path) -> None:
    async with open_memnet() as net:
        for name in ("honest", "liar"):
            net.serve(name, blocks.load_span(tiny_llama, 0, TINY_BLOCKS))
        view = view_over(net)
        liar, honest = net.peer_id("liar"), net.peer_id("honest")
        view.records[liar] = dataclasses.replace(view.records[liar], throughput=LIE)
        # Never measured, it is believed at 4 times the median, and wins.
        assert await _generate(view, push=False) == [liar]
        ran = 1 / (view.speeds[liar] * TINY_BLOCKS)  # tokens/s through its span, as we timed it
        # The honest server announces 3 times what the liar ran: without our timings the liar
        # (believed at 4 times the median) would still win; with them it is believed at most
        # MEASURED_SLACK times what it ran, and loses.
        view.records[honest] = dataclasses.replace(view.records[honest], throughput=3 * ran)
        snapshot = view.snapshot()
        assert [hop.peer_id for hop in plan_route(snapshot, rtts=view.rtts)] == [liar]
        assert MEASURED_SLACK < 3
        assert [hop.peer_id for hop in view.plan()] == [honest]
