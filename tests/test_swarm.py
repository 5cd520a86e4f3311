"""The swarm end to end: real `peerd start` daemons in separate processes on 127.0.0.1 serving
the default model, and a leeching client in the test process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import trio
from libp2p.peer.id import ID

import wire
from peerd.devtools.localswarm import LocalSwarm
from peerd.node.p2p import INFERENCE_PROTOCOL, PUSH_PROTOCOL
from peerd.node.streams import MessageStream
from peerd.server.block_server import MAX_PUSHED_QUEUED
from peerd.session.inference import InferenceSession
from peerd.session.leech import open_leech
from tests.conftest import greedy_continuation, three_servers_of_ten

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def reference(local_model: Any, tokenizer: Any) -> dict[str, list[int]]:
    """PROMPT's token ids and its greedy continuation by plain transformers on the whole model."""
    ids = tokenizer(PROMPT)["input_ids"]
    return {"ids": ids, "new": greedy_continuation(local_model, tokenizer, PROMPT, 40)}


@pytest.fixture(scope="module")
def three_servers() -> Iterator[LocalSwarm]:
    """This module's own swarm: its tests kill and restart servers."""
    yield from three_servers_of_ten()


async def _generate(leech, ids: list[int], n: int, on_token=None) -> list[int]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    prompt = torch.tensor([ids])
    async with InferenceSession(leech.swarm, max_length=len(ids) + n) as session:
        async for token in leech.generator.generate(prompt, n, session=session):
            tokens.append(int(token[0, 0]))
            if on_token is not None:
                await on_token(len(tokens), session)
    return tokens


async def test_three_daemons_match_local_greedy(three_servers: LocalSwarm, reference) -> None:  # type: ignore[no-untyped-def]
    async with open_leech("default", three_servers.initial_peers, refresh_period=2.0) as leech:
        tokens = await _generate(leech, reference["ids"], 32)
    assert tokens == reference["new"][:32]


async def test_bad_peers_get_clear_errors_and_server_keeps_serving(
    three_servers: LocalSwarm,
    reference,  # type: ignore[no-untyped-def]
) -> None:
    server = three_servers.daemons[1]  # blocks 10:20
    async with open_leech("default", three_servers.initial_peers, refresh_period=2.0) as leech:
        host = leech.node.host
        peer = ID.from_base58(server.peer_id)

        async def open_raw() -> MessageStream:
            return MessageStream(
                await host.new_stream(peer, [INFERENCE_PROTOCOL]), wire.DEFAULT_MAX_FRAME_SIZE
            )

        # A session that stays open the whole time must keep working.
        async with InferenceSession(leech.swarm, max_length=64) as healthy:
            hidden = torch.randn(1, 3, 576)
            first = await healthy.step(hidden)

            # 1. A malformed frame: garbage bytes.
            bad = await open_raw()
            await bad.stream.write(b"\x00\x00\x00\x05hello")
            reply = await bad.receive(10)
            assert isinstance(reply, wire.Error) and reply.message

            async def session_reply(start: int, end: int, step: torch.Tensor | None) -> object:
                """Open a session on blocks start:end (and send one step): the last reply."""
                bad = await open_raw()
                request = wire.OpenSession(
                    session_id="s", model=leech.swarm.model, start=start, end=end, max_length=16
                )
                await bad.send(request)
                reply = await bad.receive(10)
                if step is None or not isinstance(reply, wire.SessionOpened):
                    return reply
                await bad.send(wire.Step(session_id="s", step_id=0, hidden_states=step))
                return await bad.receive(10)

            # 2. Blocks the server does not hold.
            reply = await session_reply(0, 10, None)
            assert isinstance(reply, wire.Error) and "10:20" in reply.message
            # 3. An oversize tensor: more tokens than the session's max_length.
            reply = await session_reply(10, 20, torch.zeros(1, 17, 576))
            assert isinstance(reply, wire.Error) and "max_length" in reply.message
            # 4. A tensor of the wrong width.
            reply = await session_reply(10, 20, torch.zeros(1, 2, 100))
            assert isinstance(reply, wire.Error) and "576" in reply.message

            second = await healthy.step(hidden[:, :1])
            assert first.shape == (1, 3, 576) and second.shape == (1, 1, 576)
            assert healthy.failures == 0
        # And whole generations still come out right.
        assert await _generate(leech, reference["ids"], 8) == reference["new"][:8]


async def test_a_flood_of_pushed_steps_ends_that_session_only(three_servers: LocalSwarm) -> None:
    """A peer pushing many steps for one session without waiting for results: the session ends
    with a clear bad_request on its client's stream; the server keeps serving."""
    server = three_servers.daemons[1]  # blocks 10:20
    async with open_leech("default", three_servers.initial_peers, refresh_period=2.0) as leech:
        peer = ID.from_base58(server.peer_id)

        async def open_raw(protocol: str) -> MessageStream:
            raw = await leech.node.host.new_stream(peer, [protocol])
            return MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)

        session = await open_raw(INFERENCE_PROTOCOL)
        await session.send(
            wire.OpenSession(session_id="flood", model=leech.swarm.model, start=10, end=20,
                             max_length=64)
        )  # fmt: skip
        assert isinstance(await session.receive(10), wire.SessionOpened)
        push = await open_raw(PUSH_PROTOCOL)
        for step_id in range(3 * MAX_PUSHED_QUEUED):  # back to back: far more than may wait
            await push.send(
                wire.Step(session_id="flood", step_id=step_id, hidden_states=torch.randn(1, 1, 576))
            )
        replies = []
        with trio.fail_after(60):
            while not isinstance(reply := await session.receive(60), wire.Error):
                replies.append(reply)
        assert reply.code == wire.ErrorCode.BAD_REQUEST and "pushed steps wait" in reply.message, (
            reply
        )
        assert all(isinstance(r, wire.StepResult) for r in replies)
        assert len(replies) < 3 * MAX_PUSHED_QUEUED  # refused before it ran them all
        await push.close()
        # The server still serves everyone else.
        async with InferenceSession(leech.swarm, max_length=8) as healthy:
            assert (await healthy.step(torch.randn(1, 2, 576))).shape == (1, 2, 576)


async def test_server_killed_mid_generation_is_replaced(reference) -> None:  # type: ignore[no-untyped-def]
    swarm = LocalSwarm()
    try:
        swarm.start("a", "0:10")
        b1 = swarm.start("b1", "10:20")
        b2 = swarm.start("b2", "10:20")
        swarm.start("c", "20:30")
        stalls: list[float] = []
        async with open_leech("default", swarm.initial_peers, refresh_period=2.0) as leech:
            killed: dict[str, str] = {}
            last = [time.perf_counter()]

            async def on_token(n: int, session: InferenceSession) -> None:
                now = time.perf_counter()
                stalls.append(now - last[0])
                last[0] = now
                if n == 10:
                    victim = next(h.peer_id for h in session.hops if h.hop.start == 10)
                    target = b1 if b1.peer_id == victim else b2
                    target.kill()
                    killed["peer"] = victim

            tokens = await _generate(leech, reference["ids"], 40, on_token)
        assert killed, "the middle server was never on the route"
        assert tokens == reference["new"][:40]
        print(
            f"token gaps: median {sorted(stalls)[len(stalls) // 2]:.3f} s, "
            f"worst {max(stalls):.3f} s (the stall after the kill)"
        )
    finally:
        swarm.stop()


async def test_a_server_killed_during_a_pipelined_prompt_is_replaced(
    local_model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 200-token prompt pipelined in 3 chunks (forced: these daemons share a host) through real
    daemons and py-libp2p push streams. The middle server is killed once the first server has
    answered the first chunk, so while chunks are in flight on every hop: it is banned and
    replaced, the prompt runs again whole, and the tokens are plain transformers' greedy ones."""
    from peerd.bench.swarm import PROMPT as LONG_PROMPT
    from peerd.session.route import RouteKeeper

    text = LONG_PROMPT + " " + LONG_PROMPT
    ids = tokenizer(text)["input_ids"]
    assert 160 <= len(ids) < 256  # 3 chunks of at least 64 tokens
    expected = greedy_continuation(local_model, tokenizer, text, 8)
    swarm = LocalSwarm()
    try:
        swarm.start("a", "0:10")
        middle = {"b1": swarm.start("b1", "10:20"), "b2": swarm.start("b2", "10:20")}
        swarm.start("c", "20:30")
        async with open_leech("default", swarm.initial_peers, refresh_period=2.0) as leech:
            assert await leech.swarm.wait_for(lambda snap: len(snap.records) == 4, 60)
            killed: list[str] = []
            remember = RouteKeeper.remember

            def remembered(keeper: RouteKeeper, block: int, hidden: torch.Tensor) -> None:
                remember(keeper, block, hidden)
                if block == 0 and not killed:  # the first server's reply to the first chunk
                    victim = next(h.peer_id for h in keeper.hops if h.hop.start == 10)
                    next(d for d in middle.values() if d.peer_id == victim).kill()
                    killed.append(victim)

            monkeypatch.setattr(RouteKeeper, "remember", remembered)
            tokens: list[int] = []
            prompt = torch.tensor([ids])
            async with InferenceSession(
                leech.swarm, max_length=len(ids) + 8, pipeline=True
            ) as session:
                async for token in leech.generator.generate(prompt, 8, session=session):
                    tokens.append(int(token[0, 0]))
                assert killed and session.failures == 1
                assert session.hops[1].peer_id != killed[0]
        assert tokens == expected
    finally:
        swarm.stop()


# A --memory-budget that fits 10 blocks of SmolLM2 with --cache-tokens 1024, not 11: a block is
# 13.5 MiB of fp32 weights (blocks.block_bytes) and 1.5 MiB of KV cache, so 155 MiB is 10.3 blocks.
TEN_BLOCKS_BUDGET = 155 * 2**20


async def test_blocks_auto_daemons_cover_the_model() -> None:
    swarm = LocalSwarm()
    budget = ["--memory-budget", str(TEN_BLOCKS_BUDGET), "--cache-tokens", "1024"]
    try:
        spans = []
        for name in ("x", "y", "z"):
            daemon = swarm.start(name, "auto", *budget)
            assert daemon.span is not None
            spans.append(daemon.span)
        served = set().union(*(range(a, b) for a, b in spans))
        assert served == set(range(30)), spans
        async with open_leech("default", swarm.initial_peers, refresh_period=2.0) as leech:
            assert len(leech.swarm.plan()) == 3
    finally:
        swarm.stop()


async def test_restarted_server_is_routed_again(three_servers: LocalSwarm) -> None:
    middle = three_servers.daemons[1]
    async with open_leech("default", three_servers.initial_peers, refresh_period=2.0) as leech:
        middle.kill()
        leech.swarm.report_failure(middle.peer_id)
        await leech.swarm.refresh()
        assert middle.peer_id not in leech.swarm.records
        restarted = three_servers.start("b-again", "10:20", identity="b")
        assert restarted.peer_id == middle.peer_id
        started = time.perf_counter()
        with trio.fail_after(three_servers.refresh_period * 3):
            while middle.peer_id not in leech.swarm.records:
                await trio.sleep(0.2)
        print(f"restarted server back in the view after {time.perf_counter() - started:.2f} s")
        route = leech.swarm.plan()
        assert [hop.peer_id for hop in route][1] == middle.peer_id


async def test_sigterm_drains_and_removes_the_socket() -> None:
    swarm = LocalSwarm()
    try:
        daemon = swarm.start("solo", "0:30")
        assert daemon.socket.exists()
        started = time.perf_counter()
        assert daemon.terminate(timeout=60) == 0
        print(f"SIGTERM to exit: {time.perf_counter() - started:.2f} s")
        assert not daemon.socket.exists()
    finally:
        swarm.stop()


async def test_auto_servers_move_to_fill_a_gap() -> None:
    """Four --blocks auto servers of 10 blocks each; the one holding 10:20 dies; one of the
    two holding the same other span moves there, and the model is whole again."""
    swarm = LocalSwarm()
    auto = ["--memory-budget", str(TEN_BLOCKS_BUDGET), "--cache-tokens", "1024",
            "--rebalance-period", "2"]  # fmt: skip
    try:
        daemons = [swarm.start(name, "auto", *auto) for name in ("w", "x", "y", "z")]
        spans = [d.span for d in daemons]
        victim = next(d for d in daemons if d.span == (10, 20))
        assert sorted(set(spans)) == [(0, 10), (10, 20), (20, 30)], spans
        victim.kill()
        started = time.perf_counter()
        # Generous deadlines: on a loaded 2-core machine a move (drain, load, announce) is slow.
        async with open_leech(
            "default", swarm.initial_peers, refresh_period=2.0, wait_for_coverage_s=120
        ) as leech:
            with trio.fail_after(120):
                while True:
                    await leech.swarm.refresh()
                    snapshot = leech.swarm.snapshot()
                    if not snapshot.uncovered_blocks() and victim.peer_id not in snapshot.by_peer:
                        break
                    await trio.sleep(0.5)
            healed = time.perf_counter() - started
            tokens = await _generate(leech, leech.client.tokenizer(PROMPT)["input_ids"], 4)
        print(f"blocks 10:20 served again {healed:.1f} s after their server died")
        assert len(tokens) == 4
    finally:
        swarm.stop()
