"""A step that needs only its last positions (a prompt, before its next token) gets only those
from the route's last server (wire.Step.reply_last, InferenceSession.step(keep_last=...)): pushed
or relayed, whole or pipelined, after a failover and a spot check, against real BlockServers in
one process (tests/memnet.py); and a server unaware of the field, which answers whole, is still
right."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import blocks
import wire
from peerd.node.streams import MessageStream
from peerd.server.block_server import TEST_CORRUPT_ENV
from peerd.server.sessions import InferenceHandler
from peerd.session.inference import InferenceSession
from tests.memnet import MemNet, open_memnet, random_steps, view_over, whole_output
from tests.numeric import assert_close_scaled

SPANS = {"head": (0, 2), "mid": (2, 4), "tail": (4, 6)}


def _replies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(step id, positions) of every StepResult any server sends from now on."""
    seen: list[tuple[int, int]] = []
    send = MessageStream.send

    async def recording(self: MessageStream, message: Any, *a: Any, **kw: Any) -> None:
        if isinstance(message, wire.StepResult):
            seen.append((message.step_id, int(message.hidden_states.shape[1])))
        await send(self, message, *a, **kw)

    monkeypatch.setattr(MessageStream, "send", recording)
    return seen


def _serve(net: MemNet, tiny_llama: Path, names: dict[str, tuple[int, int]] = SPANS) -> None:
    for name, (start, end) in names.items():
        net.serve(name, blocks.load_span(tiny_llama, start, end))


@pytest.mark.parametrize(
    ("push", "first_step", "pipeline"),
    [(True, True, False), (True, False, False), (True, True, True), (False, False, False)],
    ids=["pushed-with-open", "pushed", "pipelined", "relayed"],
)
async def test_the_last_server_sends_back_only_the_positions_kept(
    tiny_llama: Path,
    whole: blocks.Span,
    monkeypatch: pytest.MonkeyPatch,
    push: bool,
    first_step: bool,
    pipeline: bool,
) -> None:
    steps = random_steps(21, (130, 1, 4))
    expected = whole_output(whole, steps)
    async with open_memnet() as net:
        _serve(net, tiny_llama)
        replies = _replies(monkeypatch)
        async with InferenceSession(
            view_over(net),
            max_length=140,
            push=push,
            open_with_first_step=first_step,
            pipeline=pipeline,
        ) as session:
            with trio.fail_after(30):
                prompt = await session.step(steps[0], keep_last=1)
                token = await session.step(steps[1], keep_last=1)
                three = await session.step(steps[2], keep_last=3)
            assert session.position == 135 and session.failures == 0
            with pytest.raises(ValueError, match="keep_last"):
                await session.step(steps[1], keep_last=0)
            assert session.position == 135
    assert prompt.shape == (1, 1, steps[0].shape[2])
    assert_close_scaled(prompt, expected[:, 129:130])
    assert_close_scaled(token, expected[:, 130:131])
    assert_close_scaled(three, expected[:, 132:135])
    sizes = [n for _, n in replies]
    if pipeline:  # 2 chunks of 65: head and mid answer each whole, tail its last position
        assert sorted(sizes[:6]) == [1, 1, 65, 65, 65, 65]
    else:
        assert sorted(sizes[:3]) == [1, 130, 130]  # the prompt: tail's reply is one row
    assert sorted(sizes[-3:]) == [3, 4, 4]


async def test_a_server_that_ignores_reply_last_and_answers_whole_is_not_blamed(
    tiny_llama: Path, whole: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older server knows no reply_last (unknown fields are skipped) and sends every
    position back: the client cuts the reply itself and keeps the server."""
    steps = random_steps(22, (40, 1))
    process = InferenceHandler._process

    async def unaware(self: InferenceHandler, live: Any, message: wire.Step, **kw: Any) -> None:
        await process(self, live, _with_reply_last(message, None), **kw)

    monkeypatch.setattr(InferenceHandler, "_process", unaware)
    async with open_memnet() as net:
        _serve(net, tiny_llama)
        replies = _replies(monkeypatch)
        async with InferenceSession(view_over(net), max_length=50) as session:
            with trio.fail_after(30):
                outputs = [await session.step(hidden, keep_last=1) for hidden in steps]
            assert session.failures == 0 and session.position == 41
    assert sorted(n for _, n in replies[:3]) == [40, 40, 40]
    expected = whole_output(whole, steps)
    assert_close_scaled(torch.cat(outputs, dim=1), expected[:, [39, 40]])


@pytest.mark.parametrize("push", [True, False])
async def test_a_reply_of_some_other_length_is_a_bad_reply(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, push: bool
) -> None:
    """Asked for its last position, a server answers two: that is neither the step's shape
    nor what it asked for, and the client moves the hop to another server (blaming it for a
    step it sent it, not for one pushed to it: the server before may have sent it garbage)."""
    steps = random_steps(23, (20,))
    process = InferenceHandler._process

    async def greedy(self: InferenceHandler, live: Any, message: wire.Step, **kw: Any) -> None:
        if message.reply_last == 1 and getattr(self.server, "name", None) == "tail-1":
            message = _with_reply_last(message, 2)
        await process(self, live, message, **kw)

    monkeypatch.setattr(InferenceHandler, "_process", greedy)
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail-1": (3, 6), "tail-2": (3, 6)})
        net.server("tail-1").name = "tail-1"  # type: ignore[attr-defined]
        view = view_over(net)
        view.records = net.records(["head", "tail-1"])  # the first route goes through tail-1
        async with InferenceSession(view, max_length=30, push=push) as session:
            # The replacement is tail-2 (a hop moved without blame may go back to its server).
            view.records = net.records(["head", "tail-2"])
            with trio.fail_after(30):
                out = await session.step(steps[0], keep_last=1)
            blamed = (session.failures, session.route_keeper.unattributed)
            assert blamed == ((0, 1) if push else (1, 0))
            assert session.hops[1].peer_id == net.peer_id("tail-2")
    assert out.shape[1] == 1


def _with_reply_last(message: wire.Step, last: int | None) -> wire.Step:
    return dataclasses.replace(message, reply_last=last)


async def test_a_lying_last_server_is_caught_on_the_positions_it_sent(
    tiny_llama: Path, whole: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spot checks compare the one row the last server sent with the same row of a second
    server's output, catch the liar, and the step's output is the honest one."""
    steps = random_steps(24, (30, 1))
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3)})
        monkeypatch.setenv(TEST_CORRUPT_ENV, "1")  # every step it answers is wrong
        net.serve("liar", blocks.load_span(tiny_llama, 3, 6))
        monkeypatch.delenv(TEST_CORRUPT_ENV)
        _serve(net, tiny_llama, {"honest-1": (3, 6), "honest-2": (3, 6)})
        view = view_over(net)
        view.records = net.records(["head", "liar"])
        async with InferenceSession(view, max_length=40, verify_fraction=1.0) as session:
            view.records = net.records()
            with trio.fail_after(30):
                outputs = [await session.step(hidden, keep_last=1) for hidden in steps]
            assert session.verifier is not None
            assert [m.liar for m in session.verifier.mismatches] == [net.peer_id("liar")]
    expected = whole_output(whole, steps)
    assert_close_scaled(torch.cat(outputs, dim=1), expected[:, [29, 30]])


async def test_the_last_server_killed_mid_step_is_replaced_and_the_kept_positions_come(
    tiny_llama: Path, whole: blocks.Span
) -> None:
    steps = random_steps(25, (30, 1))
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"head": (0, 3), "tail-1": (3, 6), "tail-2": (3, 6)})
        view = view_over(net)
        view.records = net.records(["head", "tail-1"])
        async with InferenceSession(view, max_length=40) as session:
            view.records = net.records()
            tail = net.server("tail-1").batcher
            run = tail.run

            async def dying(*a: Any, **kw: Any) -> Any:
                net.kill("tail-1")
                await trio.sleep_forever()

            tail.run = dying  # type: ignore[method-assign]
            with trio.fail_after(30):
                outputs = [await session.step(hidden, keep_last=1) for hidden in steps]
            tail.run = run  # type: ignore[method-assign]
            assert session.failures == 1
            assert session.hops[1].peer_id == net.peer_id("tail-2")
    expected = whole_output(whole, steps)
    assert_close_scaled(torch.cat(outputs, dim=1), expected[:, [29, 30]])


def test_keep_last_must_be_positive_and_reply_last_is_checked_on_the_wire() -> None:
    step = _with_reply_last(
        wire.Step(session_id="s", step_id=0, hidden_states=torch.zeros(1, 2, 4)), 1
    )
    decoded = wire.decode_message(wire.encode_message(step))
    assert isinstance(decoded, wire.Step) and decoded.reply_last == 1
    with pytest.raises(wire.ProtocolError, match="reply_last"):
        _with_reply_last(step, 0).check()
