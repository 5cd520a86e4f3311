"""Hostile replies into the client, against real BlockServers in one process (tests/memnet.py): a
server whose step results have the wrong shape, too many tokens, NaN or inf, or a step id never
sent is that hop's failure (banned, routed around, its cache replayed elsewhere), never a crash
or wrong text; a server that pushes a bad output on is not allowed to get the honest next hop
banned. Each output is compared with the whole model run in one piece (tiny random llama)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import blocks
import wire
from peerd.node.streams import MessageStream, PeerGone
from peerd.server.block_server import BlockServer
from peerd.session.inference import InferenceSession
from tests.memnet import (
    MemNet,
    open_memnet,
    random_steps,
    stream_pair,
    view_over,
    whole_output,
)
from tests.numeric import assert_close_scaled

HIDDEN = 32  # the tiny llama's hidden size
MAX_FRAME = wire.DEFAULT_MAX_FRAME_SIZE

Tamper = Callable[[wire.StepResult], bytes]  # a step result -> the frame sent instead
MARKER = 1234.5  # a float32 a tensor of the tiny llama never holds: its bytes get overwritten


def _with_hidden(result: wire.StepResult, hidden: torch.Tensor) -> bytes:
    reply = wire.StepResult(
        session_id=result.session_id,
        step_id=result.step_id,
        hidden_states=hidden.contiguous(),
        push_failed=result.push_failed,
    )
    return bytes(wire.encode_message(reply))


def _with_value(result: wire.StepResult, value: float) -> bytes:
    """The result with one value replaced by `value` in the frame's raw bytes: our encoder
    refuses NaN and inf, a hostile server's need not."""
    hidden = result.hidden_states.clone()
    hidden[0, -1, 1] = MARKER
    frame = _with_hidden(result, hidden)
    marker = struct.pack("<f", MARKER)
    assert frame.count(marker) == 1
    return frame.replace(marker, struct.pack("<f", value))


def _huge(hidden: torch.Tensor) -> torch.Tensor:
    """Finite as sent (float64), inf in the client's float32."""
    hidden[0, 0, 0] = 1e300
    return hidden


TAMPERS: dict[str, Tamper] = {
    "narrower": lambda r: _with_hidden(r, r.hidden_states[..., :-1]),
    "wider": lambda r: _with_hidden(r, torch.cat([r.hidden_states, r.hidden_states], dim=2)),
    "more tokens": lambda r: _with_hidden(r, torch.cat([r.hidden_states] * 3, dim=1)),
    "fewer tokens": lambda r: _with_hidden(r, r.hidden_states[:, 1:]),  # the prompt has 4
    "nan": lambda r: _with_value(r, float("nan")),
    "inf": lambda r: _with_value(r, float("-inf")),
    "float64 past float32": lambda r: _with_hidden(r, _huge(r.hidden_states.double())),
    "another step id": lambda r: bytes(
        wire.encode_message(
            wire.StepResult(
                session_id=r.session_id, step_id=r.step_id + 7, hidden_states=r.hidden_states
            )
        )
    ),
}


def _serve(net: MemNet, path: Path, spans: dict[str, tuple[int, int]]) -> None:
    for name, (start, end) in spans.items():
        net.serve(name, blocks.load_span(path, start, end))


def make_hostile(server: BlockServer, tamper: Tamper) -> None:
    """`server` answers its clients through a proxy that tampers with every step result (its
    real handler, pushes included, runs behind it)."""
    honest = server.handle_inference

    async def hostile(stream: Any, remote_peer: str | None = None) -> None:
        assert remote_peer is not None
        ours, theirs = stream_pair(remote_peer, server.peer_id)
        outer, inner = MessageStream(stream, MAX_FRAME), MessageStream(ours, MAX_FRAME)

        async def to_server() -> None:
            while True:
                await inner.send(await outer.receive(60))

        async def to_client() -> None:
            while True:
                message = await inner.receive(60)
                if not isinstance(message, wire.StepResult):
                    await outer.send(message)
                    continue
                try:
                    await stream.write(tamper(message))
                except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    raise PeerGone("the client went away") from e

        async def until_gone(direction: Callable[[], Any], nursery: trio.Nursery) -> None:
            try:
                await direction()
            except PeerGone:  # either end closed: the proxy ends
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(honest, theirs, remote_peer)
            nursery.start_soon(until_gone, to_server, nursery)
            nursery.start_soon(until_gone, to_client, nursery)

    server.handle_inference = hostile  # type: ignore[method-assign]


@pytest.mark.parametrize("push", [True, False], ids=["push", "relay"])
@pytest.mark.parametrize("tamper", list(TAMPERS))
async def test_a_hostile_reply_is_that_hops_failure_never_a_crash(
    tiny_llama: Path, whole: blocks.Span, tamper: str, push: bool
) -> None:
    """The route can only start at the hostile server; once it is caught, a spare takes its
    blocks with the cache replayed. The honest servers are never blamed."""
    steps = random_steps(5, (4, 1, 1))
    reference = whole_output(whole, steps)
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"hostile": (0, 3), "tail": (3, 6), "spare": (0, 3)})
        make_hostile(net.server("hostile"), TAMPERS[tamper])
        view = view_over(net, ["hostile", "tail"])
        async with InferenceSession(view, max_length=16, push=push) as session:
            assert session.hops[0].peer_id == net.peer_id("hostile")
            view.records = net.records()  # the spare appears
            with trio.fail_after(30):
                outputs = [await session.step(hidden) for hidden in steps]
            assert session.hops[0].peer_id == net.peer_id("spare")
            assert session.failures == 1
            assert view.bans.failures(net.peer_id("hostile")) == 1
            for honest in ("tail", "spare"):
                assert view.bans.failures(net.peer_id(honest)) == 0
    out = torch.cat(outputs, dim=1)
    assert bool(torch.isfinite(out).all())
    assert_close_scaled(out, reference)


async def test_a_bad_push_is_not_blamed_on_the_honest_hop_that_refuses_it(
    tiny_llama: Path, whole: blocks.Span, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first server answers us well but pushes an oversized output on: the honest next
    server refuses it. Nothing tells us which of the two is at fault, so neither is banned;
    the session moves the refusing hop, stops pushing and relays every step itself, where each
    output is checked before the next server sees it."""
    steps = random_steps(6, (4, 1, 1, 1))
    reference = whole_output(whole, steps)
    async with open_memnet() as net:
        _serve(net, tiny_llama, {"pusher": (0, 3), "tail": (3, 6)})
        pusher = net.server("pusher").sessions.pusher
        honest_push = pusher.push

        async def oversized_push(message: wire.Step, output: torch.Tensor, codec: str) -> bool:
            return await honest_push(message, torch.cat([output] * 8, dim=1), codec)

        monkeypatch.setattr(pusher, "push", oversized_push)
        view = view_over(net, ["pusher", "tail"])
        async with InferenceSession(view, max_length=16) as session:
            with trio.fail_after(30):
                outputs = [await session.step(hidden) for hidden in steps]
            assert session.failures == 0
            assert session.route_keeper.unattributed == 1
            assert not session.route_keeper.pushing
            for name in ("pusher", "tail"):
                assert view.bans.failures(net.peer_id(name)) == 0
                assert net.peer_id(name) in view.records
    assert_close_scaled(torch.cat(outputs, dim=1), reference)
