"""The client session against real BlockServers in one process (tests/memnet.py): failover with
replay, a cancelled step's late reply dropped, a lying server caught by the spot checks and
routed around, and a bug of ours that bans no server. Each output is compared with the whole
model run in one piece (tiny random llama, 6 blocks), within a tolerance scaled to the values'
magnitude."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from libp2p.peer.id import ID

import blocks
import wire
from peerd.node.p2p import PUSH_PROTOCOL
from peerd.node.streams import MessageStream
from peerd.server import push
from peerd.server.block_server import TEST_CORRUPT_ENV
from peerd.session import hops
from peerd.session.generation import Generator
from peerd.session.inference import InferenceSession
from tests.memnet import (
    MemNet,
    open_memnet,
    random_steps,
    view_over,
    whole_output,
)
from tests.numeric import assert_close_scaled
from wire.conversation import ClientInference

HIDDEN = 32  # the tiny llama's hidden size


def _serve(net: MemNet, path: Path, spans: dict[str, tuple[int, int]]) -> None:
    for name, (start, end) in spans.items():
        net.serve(name, blocks.load_span(path, start, end))


def _name_of(net: MemNet, peer_id: str, names: list[str]) -> str:
    return next(name for name in names if net.peer_id(name) == peer_id)


async def test_a_killed_server_is_replaced_and_its_cache_replayed(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    steps = random_steps(0, (5, 1, 1, 1, 1, 1))
    reference = whole_output(whole, steps)
    names = ["head", "tail-1", "tail-2"]
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail-1": (3, 6), "tail-2": (3, 6)})
        view = view_over(net)
        async with InferenceSession(view, max_length=16) as session:
            outputs = []
            for i, hidden in enumerate(steps):
                if i == 3:  # mid-generation: the server of blocks 3:6 dies with its cache
                    victim = _name_of(net, session.hops[1].peer_id, names)
                    net.kill(victim)
                outputs.append(await session.step(hidden))
            survivor = _name_of(net, session.hops[1].peer_id, names)
            assert {victim, survivor} == {"tail-1", "tail-2"}
            assert session.failures == 1
            assert view.bans.failures(net.peer_id(victim)) == 1
            assert net.peer_id(victim) not in view.records
            assert session.position == sum(s.shape[1] for s in steps)
    assert_close_scaled(torch.cat(outputs, dim=1), reference)


@pytest.fixture
def gate() -> Iterator[dict[str, Any]]:
    yield {"armed": False, "entered": trio.Event(), "release": trio.Event()}


async def test_a_cancelled_steps_late_reply_is_dropped_not_blamed_on_the_server(
    tiny_llama: Path,
    whole: blocks.Span,
    monkeypatch: pytest.MonkeyPatch,
    gate: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C in `peerd chat` while the last server computes: its reply comes after the cancel.
    The next step must read its own reply, and the server must not count as failed (no other
    server holds its blocks here, so a failure would end the session)."""
    first, cancelled, after = random_steps(1, (4, 1, 2))
    reference = whole_output(whole, [first, after])
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail": (3, 6)})
        tail = net.server("tail")
        run_step = tail.run_step

        async def slow_run_step(*args: Any, **kwargs: Any) -> torch.Tensor:
            if gate["armed"]:
                gate["armed"] = False
                gate["entered"].set()
                await gate["release"].wait()
            return await run_step(*args, **kwargs)

        monkeypatch.setattr(tail, "run_step", slow_run_step)
        view = view_over(net)
        async with InferenceSession(view, max_length=16) as session:
            out_first = await session.step(first)
            gate["armed"] = True
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.step, cancelled)
                    await gate["entered"].wait()  # the tail holds the step: cancel it now
                    scope.cancel()
            assert scope.cancelled_caught
            gate["release"].set()  # the tail answers the cancelled step, late
            with caplog.at_level(logging.DEBUG, logger="peerd.session.hops"):
                out_after = await session.step(after)
            assert any("late reply" in r.getMessage() for r in caplog.records)
            assert session.failures == 0
            assert net.peer_id("tail") in view.records
            assert view.bans.failures(net.peer_id("tail")) == 0
            assert session.position == first.shape[1] + after.shape[1]
    assert_close_scaled(torch.cat([out_first, out_after], dim=1), reference)


async def test_a_lying_server_is_caught_banned_and_routed_around(
    tiny_llama: Path, whole: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = random_steps(2, (6, 1, 1))
    reference = whole_output(whole, steps)
    async with open_memnet() as net:
        monkeypatch.setenv(TEST_CORRUPT_ENV, "1")  # every step it answers is wrong
        _serve(net, tiny_llama, {"liar": (3, 6)})
        monkeypatch.delenv(TEST_CORRUPT_ENV)
        _serve(net, tiny_llama, {"head": (0, 3), "honest-1": (3, 6), "honest-2": (3, 6)})
        view = view_over(net, ["head", "liar"])  # the route can only go through the liar...
        async with InferenceSession(view, max_length=16, verify_fraction=1.0) as session:
            assert session.hops[1].peer_id == net.peer_id("liar")
            view.records = net.records()  # ...then the checkers appear
            outputs = [await session.step(hidden) for hidden in steps]
            liar = net.peer_id("liar")
            assert session.hops[1].peer_id != liar
            assert session.verifier is not None
            assert [m.liar for m in session.verifier.mismatches] == [liar]
            assert view.bans.is_liar(liar, time.time())
    assert_close_scaled(torch.cat(outputs, dim=1), reference)


async def test_our_own_bug_propagates_and_bans_no_server(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug on our side while opening a hop is raised as itself: the server that answered well
    is not reported failed, banned or dropped from the view."""

    class BuggyConversation(ClientInference):
        def received(self, message: wire.Message) -> Any:
            raise RuntimeError("a bug of ours")

    async with open_memnet() as net:
        _serve(net, tiny_llama, {"whole": (0, 6), "spare": (0, 6)})
        view = view_over(net)
        monkeypatch.setattr(hops, "ClientInference", BuggyConversation)
        with pytest.raises(RuntimeError, match="a bug of ours"):
            async with InferenceSession(view, max_length=16):
                pass
        for name in ("whole", "spare"):
            assert view.bans.failures(net.peer_id(name)) == 0
        assert set(view.records) == {net.peer_id("whole"), net.peer_id("spare")}


async def test_hops_name_their_upstream_and_pushes_stop_before_a_replaced_hop(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """Each hop takes pushes only from the hop before it, so a stranger who learnt a session id
    cannot push into it; after the middle server dies, the last hop still names the dead one, so
    the step is pushed as far as the replacement and relayed to the last hop (not pushed into a
    session that would drop it and time out)."""
    steps = random_steps(3, (5, 1, 1, 1, 1))
    reference = whole_output(whole, steps)
    names = ["head", "mid-1", "mid-2", "tail"]
    spans = {"head": (0, 2), "mid-1": (2, 4), "mid-2": (2, 4), "tail": (4, 6)}
    async with open_memnet() as net:
        _serve(net, tiny_llama, spans)
        view = view_over(net)
        async with InferenceSession(view, max_length=16) as session:
            first, middle, last = session.hops
            assert first.upstream is None
            assert middle.upstream == first.peer_id and last.upstream == middle.peer_id
            outputs = [await session.step(steps[0])]
            raw = await net.node("stranger").open_stream(
                ID.from_base58(last.peer_id), PUSH_PROTOCOL
            )
            spoof = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
            garbage = torch.randn(1, 1, HIDDEN)
            spoofed = wire.Step(session_id=last.session_id, step_id=1 << 40, hidden_states=garbage)
            await spoof.send(spoofed)
            outputs.append(await session.step(steps[1]))
            victim = _name_of(net, middle.peer_id, names)
            net.kill(victim)
            for hidden in steps[2:]:
                with trio.fail_after(10):  # a push dropped by the last hop would wait 30 s
                    outputs.append(await session.step(hidden))
            assert session.failures == 1
            replacement = session.hops[1]
            assert replacement.peer_id != net.peer_id(victim)
            assert replacement.upstream == first.peer_id
            assert session.hops[2] is last and last.upstream == net.peer_id(victim)
            assert view.bans.failures(last.peer_id) == 0
    assert_close_scaled(torch.cat(outputs, dim=1), reference)


async def test_training_passes_follow_the_conversation_and_route_around_a_wrong_reply(
    tiny_llama: Path, whole: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that answers a training Forward with a BackwardResult breaks the training
    conversation: it counts as failed and is routed around (its reply is never taken as the
    pass's output), and the pass gives what the whole model gives."""
    from peerd.server import training as server_training
    from peerd.session.training import Trainer

    honest_run = server_training.run_training

    async def confused_run(server: Any, request: Any) -> Any:
        reply = await honest_run(server, request)
        if server.peer_id == net.peer_id("confused"):
            return wire.BackwardResult(grad_inputs=reply.hidden_states)
        return reply

    hidden = random_steps(4, (5,))[0]
    reference = whole_output(whole, [hidden])
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "confused": (3, 6), "spare": (3, 6)})
        monkeypatch.setattr(server_training, "run_training", confused_run)
        view = view_over(net, ["head", "confused"])  # the first plan can only use the confused one
        trainer = Trainer(view)
        first_plan = trainer._plan

        async def plan_then_show_the_spare(start: int, end: int) -> Any:
            hops = await first_plan(start, end)
            view.records = net.records()  # the spare appears for the replacement's plan
            return hops

        monkeypatch.setattr(trainer, "_plan", plan_then_show_the_spare)
        output, _, route = await trainer.forward(hidden, None, keep=False)
        assert trainer.failures == 1
        assert view.bans.failures(net.peer_id("confused")) == 1
        head, spare = net.peer_id("head"), net.peer_id("spare")
        assert route == (f"{head}[0:3)", f"{spare}[3:6)")
    assert_close_scaled(output, reference)


async def test_an_allowed_server_that_just_failed_is_waited_for_not_called_absent(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """A request failed on an allowed server a moment ago: the server is out of the view and
    banned until the ban ends and a refresh finds it again. The next session naming it in
    allowed_servers waits for it, even past a refresh that did not reach it, instead of failing
    at once with "... is not in the swarm"."""
    steps = random_steps(3, (4, 1))
    async with open_memnet() as net:
        # "other" is not allowed: without the tail, only it holds blocks 3:6.
        _serve(net, tiny_llama, {"head": (0, 3), "tail": (3, 6), "other": (0, 6)})
        view = view_over(net)
        tail = net.peer_id("tail")
        view.report_failure(tail)
        assert tail not in view.records and view.bans.is_banned(tail, time.time())
        refreshes = 0

        async def refresh() -> None:  # the first one is cut short before it reaches the tail
            nonlocal refreshes
            refreshes += 1
            if refreshes > 1:
                view.records = net.records()

        view.refresh = refresh  # type: ignore[method-assign]
        routing = wire.RouteOptions(allowed_servers=[net.peer_id("head"), tail])
        async with InferenceSession(view, max_length=16, routing=routing) as session:
            outputs = [await session.step(hidden) for hidden in steps]
            assert [hop.peer_id for hop in session.hops] == [net.peer_id("head"), tail]
        assert refreshes >= 2 and session.failures == 0
    assert_close_scaled(torch.cat(outputs, dim=1), whole_output(whole, steps))


def _micro_batches_seen(net: MemNet, names: list[str]) -> dict[str, list[int | None]]:
    """Per server, the micro_batch of every step its batcher gets from now on."""
    seen: dict[str, list[int | None]] = {name: [] for name in names}
    for name in names:
        batcher = net.server(name).batcher
        run = batcher.run

        async def recorded(*args: Any, _run: Any = run, _name: str = name, **kw: Any) -> Any:
            seen[_name].append(kw.get("micro_batch"))
            return await _run(*args, **kw)

        batcher.run = recorded  # type: ignore[method-assign]
    return seen


async def test_a_sessions_micro_batch_reaches_every_hop_pushed_or_not(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """The group a generation puts its session's steps in (wire.Step.micro_batch) is what every
    server's batcher merges by: the first hop has it from the client, the others from the
    server that pushes to them (and from the client again once it relays)."""
    steps = random_steps(4, (5, 1, 1))
    reference = whole_output(whole, steps)
    names = ["head", "mid", "tail"]
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 2), "mid": (2, 4), "tail": (4, 6)})
        seen = _micro_batches_seen(net, names)
        async with InferenceSession(view_over(net), max_length=16) as session:
            outputs = [await session.step(steps[0])]  # ungrouped
            session.micro_batch = 1
            outputs.append(await session.step(steps[1]))
            session.runner.push = False  # relayed by the client hop by hop
            outputs.append(await session.step(steps[2]))
    assert seen == {name: [None, 1, 1] for name in names}
    assert_close_scaled(torch.cat(outputs, dim=1), reference)


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
async def test_four_generations_on_cpu_servers_step_in_two_micro_batches(
    tiny_llama: Path, device: str
) -> None:
    """Four concurrent generations split into two groups of two, each tagging its steps, where
    every server of their routes computes on a CPU; on GPU servers they stay one group."""
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail": (3, 6)})
        seen = _micro_batches_seen(net, ["head", "tail"])
        view = view_over(net)
        view.records = {k: dataclasses.replace(r, device=device) for k, r in view.records.items()}
        generator = Generator(blocks.load_client_side(tiny_llama), view)

        async def generate(i: int) -> None:
            prompt = torch.tensor([[1 + i, 2, 3]])
            assert len([t async for t in generator.generate(prompt, 6)]) == 6

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(generate, i)
    for name, groups in seen.items():
        assert len(groups) == 4 * 6, name
        if device == "cpu":  # untagged while fewer than four have joined (or after one left)
            tagged = [g for g in groups if g is not None]
            assert tagged.count(0) >= 8 and tagged.count(1) >= 8, (name, groups)
        else:
            assert groups == [None] * 24, (name, groups)


async def test_sessions_in_two_micro_batches_fail_over_and_match_the_whole_model(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """Four sessions stepping at once in two micro-batch groups, as four generations on CPU
    servers do: the server of blocks 3:6 that the first of them uses dies mid-way. Every session
    that used it replaces it and replays its cache, the groups' steps keep their tags on the
    survivor, and every session's outputs match the whole model's."""
    names = ["head", "tail-1", "tail-2"]
    inputs = [random_steps(20 + k, (5, 1, 1, 1, 1, 1)) for k in range(4)]
    outputs: list[list[torch.Tensor]] = [[] for _ in inputs]
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail-1": (3, 6), "tail-2": (3, 6)})
        seen = _micro_batches_seen(net, names)
        view = view_over(net)
        async with AsyncExitStack() as stack:
            sessions = [
                await stack.enter_async_context(InferenceSession(view, max_length=16))
                for _ in inputs
            ]
            victim = _name_of(net, sessions[0].hops[1].peer_id, names)
            users = [k for k, s in enumerate(sessions) if s.hops[1].peer_id == net.peer_id(victim)]

            async def step(k: int, i: int) -> None:
                sessions[k].micro_batch = k % 2
                outputs[k].append(await sessions[k].step(inputs[k][i]))

            for i in range(len(inputs[0])):
                if i == 3:
                    net.kill(victim)
                with trio.fail_after(20):  # a step lost in a merged forward would hang
                    async with trio.open_nursery() as nursery:
                        for k in range(len(sessions)):
                            nursery.start_soon(step, k, i)
            assert [s.failures for s in sessions] == [int(k in users) for k in range(4)]
            assert all(s.hops[1].peer_id != net.peer_id(victim) for s in sessions)
    survivor = next(name for name in names[1:] if name != victim)
    assert sorted(g for g in seen["head"] if g is not None) == [0] * 12 + [1] * 12
    # The survivor: each moved session's replay (ungrouped), then its last 3 steps in its
    # group; a session routed there from the start, all 6 of its steps.
    moved = [k % 2 for k in users for _ in range(3)]
    stayed = [k % 2 for k in range(4) if k not in users for _ in range(6)]
    assert seen[survivor].count(None) == len(users)
    assert sorted(g for g in seen[survivor] if g is not None) == sorted(moved + stayed)
    for k, steps in enumerate(inputs):
        assert_close_scaled(torch.cat(outputs[k], dim=1), whole_output(whole, steps))


async def test_a_first_step_opens_the_route_and_an_early_push_waits_for_its_session(
    tiny_llama: Path, whole: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    """open_with_first_step: the session's first step goes to the first hop with its
    OpenSession, and that server pushes its output on while the next hop's session is still
    opening (held back here): the next server holds the push until the session opens, then
    runs it, and the outputs match the whole model's."""
    steps = random_steps(6, (5, 1, 1))
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail": (3, 6)})
        sessions = net.server("tail").sessions
        handle, claim = sessions.handle, sessions.pushes.claim
        claimed: list[bool] = []

        async def late_handle(messages: MessageStream) -> None:
            await trio.sleep(0.3)  # the head's push gets there first
            await handle(messages)

        def counted_claim(session_id: str) -> tuple[wire.Step, str] | None:
            early = claim(session_id)
            claimed.append(early is not None)
            return early

        monkeypatch.setattr(sessions, "handle", late_handle)
        monkeypatch.setattr(sessions.pushes, "claim", counted_claim)
        async with InferenceSession(view_over(net), max_length=16, open_with_first_step=True) as s:
            assert s.hops == []
            assert [hop.peer_id for hop in s.route] == [net.peer_id("head"), net.peer_id("tail")]
            with trio.fail_after(10):  # a push dropped by the tail would wait 60 s
                outputs = [await s.step(hidden) for hidden in steps]
            assert [hop.peer_id for hop in s.hops] == [net.peer_id("head"), net.peer_id("tail")]
            assert s.failures == 0
    assert claimed == [True]
    assert_close_scaled(torch.cat(outputs, dim=1), whole_output(whole, steps))


async def test_an_early_push_the_next_server_dropped_is_sent_again_at_once(
    tiny_llama: Path, whole: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the tail has no room to hold the head's early push (it drops it): as the
    session opens there it says so (push_dropped), and the client moves the session (the same
    server, the only one with those blocks; nobody banned) and runs the step again at once,
    instead of waiting out its step timeout for a reply that cannot come."""
    steps = random_steps(8, (5, 1, 1))
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail": (3, 6)})
        sessions = net.server("tail").sessions
        handle = sessions.handle

        async def late_handle(messages: MessageStream) -> None:
            await trio.sleep(0.3)  # the head's push gets there first
            await handle(messages)

        monkeypatch.setattr(sessions, "handle", late_handle)
        monkeypatch.setattr(push, "EARLY_PUSH_BYTES", 4)  # no step is small enough to hold
        view = view_over(net)
        async with InferenceSession(view, max_length=16, open_with_first_step=True) as s:
            with trio.fail_after(10):  # the dropped push would wait 60 s
                outputs = [await s.step(hidden) for hidden in steps]
            assert [hop.peer_id for hop in s.hops] == [net.peer_id("head"), net.peer_id("tail")]
            assert s.failures == 0 and s.route_keeper.unattributed == 1
        assert all(view.bans.failures(net.peer_id(name)) == 0 for name in ("head", "tail"))
    assert_close_scaled(torch.cat(outputs, dim=1), whole_output(whole, steps))


async def test_a_first_step_whose_route_fails_to_open_goes_again_on_a_new_route(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    """The planned route's second server dies before the first step: the step the first hop
    started on is dropped with its session, the dead server is banned, and the step runs on a
    route around it."""
    steps = random_steps(7, (4, 1, 1))
    names = ["head", "tail-1", "tail-2"]
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail-1": (3, 6), "tail-2": (3, 6)})
        view = view_over(net)
        async with InferenceSession(view, max_length=16, open_with_first_step=True) as session:
            victim = _name_of(net, session.route[1].peer_id, names)
            net.kill(victim)
            with trio.fail_after(10):
                outputs = [await session.step(hidden) for hidden in steps]
            assert session.failures == 1
            assert view.bans.failures(net.peer_id(victim)) == 1
            assert session.hops[1].peer_id != net.peer_id(victim)
    assert_close_scaled(torch.cat(outputs, dim=1), whole_output(whole, steps))
