"""A long pushed step (a prompt) goes through the route in chunks (peerd.session.steps): each
server gets the chunks one by one and starts on the first while the one before computes the next,
the output matches the whole model's, and a server that dies mid-pipeline is replaced and the step
run again whole. Against real BlockServers in one process (tests/memnet.py), and the policy that
decides where chunks pay."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import blocks
from peerd.server.block_server import TEST_CORRUPT_ENV
from peerd.session.inference import InferenceSession
from peerd.session.steps import PIPELINE_MAX_CHUNKS, pipeline_chunks
from routing.planner import RouteHop
from tests.memnet import (
    TINY_HIDDEN,
    MemNet,
    open_memnet,
    random_steps,
    view_over,
    whole_output,
)
from tests.numeric import assert_close_scaled
from tests.test_max_batch_size import started_with
from tests.test_routing_fixtures import make_record


def _tokens_run(net: MemNet, names: list[str]) -> dict[str, list[int]]:
    """Per server, the tokens of every step its batcher runs from now on."""
    seen: dict[str, list[int]] = {name: [] for name in names}
    for name in names:
        batcher = net.server(name).batcher
        batcher.run = _recorder(batcher.run, seen[name])  # type: ignore[method-assign]
    return seen


def _recorder(run: Any, tokens: list[int]) -> Any:
    async def recorded(span: Any, session: Any, hidden: torch.Tensor, *a: Any, **kw: Any) -> Any:
        tokens.append(int(hidden.shape[1]))
        return await run(span, session, hidden, *a, **kw)

    return recorded


@pytest.mark.parametrize("open_with_first_step", [False, True])
async def test_a_long_prompt_goes_through_the_route_in_chunks_and_matches_the_whole_model(
    tiny_llama: Path, whole: blocks.Span, open_with_first_step: bool
) -> None:
    """260 prompt tokens: 4 chunks (65 each) reach every server, pushed hop to hop (the
    first one, with open_with_first_step, carried by the first hop's OpenSession); the decode
    steps after it go whole."""
    steps = random_steps(11, (260, 1, 1))
    names = ["head", "mid", "tail"]
    async with open_memnet() as net:
        for name, (start, end) in zip(names, ((0, 2), (2, 4), (4, 6)), strict=True):
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        seen = _tokens_run(net, names)
        async with InferenceSession(
            view_over(net), max_length=270, open_with_first_step=open_with_first_step
        ) as session:
            with trio.fail_after(30):
                outputs = [await session.step(hidden) for hidden in steps]
            assert session.failures == 0 and session.position == 262
    assert seen == {name: [65, 65, 65, 65, 1, 1] for name in names}
    assert_close_scaled(torch.cat(outputs, dim=1), whole_output(whole, steps))


async def test_a_server_that_dies_mid_pipeline_is_replaced_and_the_prompt_runs_again_whole(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """The server of blocks 3:6 dies as its third chunk arrives (it holds two): it is
    banned and replaced, every hop starts over at position 0, and the prompt goes once more
    through the route whole, relayed by the client; then decoding goes on, pushed, and every
    output matches the whole model's."""
    steps = random_steps(12, (200, 1, 1))
    names = ["head", "tail-1", "tail-2"]
    async with open_memnet() as net:
        for name, (start, end) in zip(names, ((0, 3), (3, 6), (3, 6)), strict=True):
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        seen = _tokens_run(net, names)
        doomed: dict[str, Any] = {"event": trio.Event(), "name": None}
        for name in ("tail-1", "tail-2"):
            run = net.server(name).batcher.run

            async def dying(*a: Any, _run: Any = run, _name: str = name, **kw: Any) -> Any:
                if len(seen[_name]) == 2 and doomed["name"] in (None, _name):
                    doomed["name"] = _name
                    doomed["event"].set()
                    await trio.sleep_forever()  # until killed
                return await _run(*a, **kw)

            net.server(name).batcher.run = dying  # type: ignore[method-assign]
        view = view_over(net)
        async with InferenceSession(view, max_length=210) as session, trio.open_nursery() as n:

            async def kill() -> None:
                await doomed["event"].wait()
                net.kill(doomed["name"])

            n.start_soon(kill)
            with trio.fail_after(30):
                outputs = [await session.step(hidden) for hidden in steps]
            victim = doomed["name"]
            survivor = "tail-2" if victim == "tail-1" else "tail-1"
            assert session.failures == 1
            assert view.bans.failures(net.peer_id(victim)) == 1
            assert session.hops[1].peer_id == net.peer_id(survivor)
    assert seen["head"] == [67, 67, 66, 200, 1, 1]  # 3 chunks, then the prompt whole
    assert seen[victim] == [67, 67]  # it took the first two chunks
    assert seen[survivor] == [200, 1, 1]  # nothing to replay (position 0), then the prompt whole
    assert_close_scaled(torch.cat(outputs, dim=1), whole_output(whole, steps))


async def test_a_lying_server_is_caught_on_a_pipelined_prompt_and_routed_around(
    tiny_llama: Path, whole: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spot checks see a pipelined prompt as one step: every hop's remembered inputs are
    its chunks' inputs in order, so a checker re-runs the liar's part and catches it."""
    steps = random_steps(13, (160, 1))
    async with open_memnet() as net:
        monkeypatch.setenv(TEST_CORRUPT_ENV, "1")  # every step it answers is wrong
        net.serve("liar", blocks.load_span(tiny_llama, 3, 6))
        monkeypatch.delenv(TEST_CORRUPT_ENV)
        for name, (start, end) in (("head", (0, 3)), ("honest-1", (3, 6)), ("honest-2", (3, 6))):
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        view = view_over(net)
        view.records = net.records(["head", "liar"])  # the route can only go through the liar
        async with InferenceSession(view, max_length=170, verify_fraction=1.0) as session:
            view.records = net.records()  # ...then the checkers appear (a verifier, a referee)
            seen = _tokens_run(net, ["liar"])
            with trio.fail_after(30):
                outputs = [await session.step(hidden) for hidden in steps]
            liar = net.peer_id("liar")
            assert seen["liar"][:2] == [80, 80]  # it got the prompt in chunks
            assert session.verifier is not None
            assert [m.liar for m in session.verifier.mismatches] == [liar]
            assert session.hops[1].peer_id in (net.peer_id("honest-1"), net.peer_id("honest-2"))
    assert_close_scaled(torch.cat(outputs, dim=1), whole_output(whole, steps))


async def test_a_pipelined_prompt_cancelled_midway_leaves_the_session_usable(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """Ctrl-C while the tail computes the second of three chunks: the session rolls back to
    where it was, the replies still owed come late and are dropped, and the next prompt runs
    (pipelined again) as if the cancelled one was never sent, blaming nobody."""
    first, cancelled, again = random_steps(14, (3, 200, 200))
    async with open_memnet() as net:
        for name, (start, end) in (("head", (0, 3)), ("tail", (3, 6))):
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        seen = _tokens_run(net, ["tail"])
        tail = net.server("tail").batcher
        run, gate = tail.run, {"entered": trio.Event(), "release": trio.Event()}

        async def held(*a: Any, **kw: Any) -> Any:
            if len(seen["tail"]) == 2:  # its second chunk (the first prompt came whole)
                gate["entered"].set()
                await gate["release"].wait()
            return await run(*a, **kw)

        tail.run = held  # type: ignore[method-assign]
        view = view_over(net)
        async with InferenceSession(view, max_length=420) as session:
            outputs = [await session.step(first)]
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.step, cancelled)
                    await gate["entered"].wait()
                    scope.cancel()
            assert scope.cancelled_caught and session.position == 3
            gate["release"].set()
            with trio.fail_after(30):
                outputs.append(await session.step(again))
            assert session.failures == 0 and session.position == 203
            assert all(view.bans.failures(peer) == 0 for peer in view.records)
    assert seen["tail"][:2] == [3, 67]  # the first prompt whole, then chunks
    assert_close_scaled(torch.cat(outputs, dim=1), whole_output(whole, [first, again]))


async def test_a_batch_of_left_padded_prompts_gives_the_same_pipelined_as_whole(
    tiny_llama: Path,
) -> None:
    """Two prompts of one batch, the second left-padded by 37 positions (its mask covers every
    chunk): pipelined, the outputs of its real tokens are those of the batch sent whole."""
    batch = torch.randn(2, 150, TINY_HIDDEN, generator=torch.Generator().manual_seed(15))
    outputs = {}
    async with open_memnet() as net:
        for name, (start, end) in (("head", (0, 3)), ("tail", (3, 6))):
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        seen = _tokens_run(net, ["head"])
        for pipeline in (False, True):
            async with InferenceSession(
                view_over(net),
                max_length=160,
                batch_size=2,
                left_padding=(0, 37),
                pipeline=pipeline,
            ) as session:
                outputs[pipeline] = await session.step(batch)
    assert seen["head"] == [150, 75, 75]
    assert_close_scaled(outputs[True][0], outputs[False][0])
    assert_close_scaled(outputs[True][1, 37:], outputs[False][1, 37:])


def _hop(peer: str, start: int, end: int, *addrs: str) -> RouteHop:
    return RouteHop(peer, start, end, make_record(peer, start, end, addrs=addrs))


def test_chunks_pay_only_where_no_two_servers_share_a_host() -> None:
    """Auto: chunks for a route across machines (in proportion to the prompt, at most
    PIPELINE_MAX_CHUNKS; longer ones for GPUs), none where two servers announce one host (a
    local swarm, one NAT) or for a short step or a single hop; relay addresses say nothing of a
    server's own host."""
    apart = [
        _hop("a", 0, 10, "/ip4/10.0.0.1/tcp/1", "/ip4/203.0.113.5/tcp/1"),
        _hop("b", 10, 20, "/ip4/10.0.0.2/tcp/1"),
        _hop("c", 20, 30, "/ip6/2001:db8::3/tcp/1", "/ip4/198.51.100.1/tcp/9/p2p/R/p2p-circuit"),
        _hop("d", 30, 32, "/dns4/example.org/tcp/1", "/ip4/198.51.100.1/tcp/9/p2p/R/p2p-circuit"),
    ]
    assert pipeline_chunks(200, apart, None) == 3
    assert pipeline_chunks(10_000, apart, None) == PIPELINE_MAX_CHUNKS
    assert pipeline_chunks(127, apart, None) == 1
    assert pipeline_chunks(200, apart[:1], None) == 1
    assert pipeline_chunks(200, apart, False) == 1
    local = [_hop(p, 10 * i, 10 * i + 10, "/ip4/127.0.0.1/tcp/1") for i, p in enumerate("abc")]
    assert pipeline_chunks(200, local, None) == 1
    assert pipeline_chunks(200, local, True) == 3
    one_nat = [apart[0], _hop("e", 10, 20, "/ip4/203.0.113.5/tcp/2")]
    assert pipeline_chunks(200, one_nat, None) == 1
    gpu = [
        dataclasses.replace(hop, record=dataclasses.replace(hop.record, device="cuda:0"))
        for hop in apart[:2]
    ]
    assert pipeline_chunks(1000, gpu, None) == 1
    assert pipeline_chunks(1024, gpu, None) == 2


@pytest.mark.parametrize(("flag", "mode"), [([], None), (["on"], True), (["off"], False)])
def test_the_flag_reaches_the_daemon_config(
    monkeypatch: pytest.MonkeyPatch, flag: list[str], mode: bool | None
) -> None:
    args = ["--pipeline-prompts", *flag] if flag else []
    result, configs = started_with(monkeypatch, *args)
    assert result.exit_code == 0, result.output
    assert configs[0].pipeline_prompts is mode


def test_a_wrong_mode_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    result, configs = started_with(monkeypatch, "--pipeline-prompts", "yes")
    assert result.exit_code == 2 and not configs
    assert "--pipeline-prompts" in result.output and "auto, on or off" in result.output


async def test_the_swarm_views_setting_decides_where_the_session_does_not(
    tiny_llama: Path,
) -> None:
    """A session left at pipeline=None follows its swarm view's pipeline_prompts (the daemon's
    --pipeline-prompts): off keeps a 200-token prompt whole on a route that would chunk it."""
    hidden = random_steps(16, (200,))[0]
    async with open_memnet() as net:
        for name, (start, end) in (("head", (0, 3)), ("tail", (3, 6))):
            net.serve(name, blocks.load_span(tiny_llama, start, end))
        seen = _tokens_run(net, ["head"])
        view = view_over(net)
        for setting in (False, None):
            view.pipeline_prompts = setting
            async with InferenceSession(view, max_length=210) as session:
                await session.step(hidden)
    assert seen["head"] == [200, 67, 67, 66]
