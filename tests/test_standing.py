"""Standing (peerd.server.standing) and who goes first by it (peerd.server.priority): pure logic
on a hand-moved clock, then the batcher and the admission queue of a real server serving
contributors first."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

import blocks
from blocks import MemoryCache, SpanSession
from peerd.daemon.contributions import Contradictions
from peerd.daemon.metrics import _standing, render
from peerd.server.admission import Admission
from peerd.server.batching import PRIORITY_TURN_TOKENS, StepBatcher
from peerd.server.block_server import BlockServer
from peerd.server.compute import ComputeQueue
from peerd.server.priority import TAKER_SHARE, Priority
from peerd.server.standing import CONTRADICTION_S, DECAY_S, QUALIFY_S, Standing
from routing.bans import BanList
from tests.test_routing_fixtures import MODEL, make_record
from tests.tiny_models import save_tiny

NUM_BLOCKS = 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _look(
    standing: Standing,
    records: list,
    bans: BanList | None = None,
    contradictions: Contradictions | None = None,
    missed: frozenset[str] = frozenset(),
    measured: dict[str, float] | None = None,
) -> None:
    """What peerd.daemon.contributions.look does with a swarm view's parts."""
    bans = bans or BanList()
    contradictions = contradictions or Contradictions()
    now = standing.clock()
    peers = {r.peer_id for r in records}
    standing.observe_swarm(
        records,
        model=MODEL,
        num_blocks=NUM_BLOCKS,
        measured=measured or {},
        contradicted=contradictions.since_last(bans, peers, now),
        unreachable=missed,
    )


def _serve_for(standing: Standing, clock: Clock, seconds: float, records: list, **kw) -> None:
    """Look every 5 s for `seconds`, the records unchanged."""
    end = clock.now + seconds
    while clock.now < end:
        _look(standing, records, **kw)
        clock.now += 5
    _look(standing, records, **kw)


def test_a_server_earns_standing_after_qualifying_by_share_and_speed() -> None:
    clock = Clock()
    standing = Standing(clock=clock)
    records = [make_record("A", 0, 10), make_record("B", 10, 20), make_record("C", 20, 30)]
    _look(standing, records)
    clock.now += QUALIFY_S / 2
    _look(standing, records)
    assert standing.of("A") == 0  # not yet qualified: a record seen once earns nothing
    _serve_for(standing, clock, QUALIFY_S, records)
    # A third of the model at the median speed, just qualified (tenure weight about a half).
    assert standing.of("A") == pytest.approx(1 / 3 * 0.5, rel=0.05)
    assert standing.of("stranger") == 0


def test_an_announced_speed_counts_only_as_far_as_measured() -> None:
    clock = Clock()
    standing = Standing(clock=clock)
    honest = [make_record("A", 0, 10), make_record("B", 10, 20)]
    boaster = make_record("L", 20, 30, throughput=1e9)
    slow = make_record("S", 0, 10, throughput=10.0)
    # Our own steps through S took 4x as long per block as the median server's announced speed.
    measured = {"S": 4 / (10.0 * 10)}
    _serve_for(standing, clock, QUALIFY_S, [*honest, boaster, slow], measured=measured)
    a, lying, s = standing.of("A"), standing.of("L"), standing.of("S")
    assert lying == pytest.approx(a, rel=1e-6)  # unmeasured: believed up to the median
    assert s == pytest.approx(a * 2 / 4, rel=1e-6)  # believed up to twice what we measured


def test_a_peer_announcing_a_span_it_does_not_serve_gets_no_standing() -> None:
    """Its record keeps looking fine, but a call to it failed (or a spot check caught it
    answering wrong): the claim earns nothing, then or for CONTRADICTION_S after."""
    clock = Clock()
    for how in ("failed call", "wrong answer"):
        standing, bans, contradictions = Standing(clock=clock), BanList(), Contradictions()
        records = [make_record("A", 0, 10), make_record("F", 10, 20), make_record("C", 20, 30)]
        _serve_for(
            standing, clock, QUALIFY_S * 2, records, bans=bans, contradictions=contradictions
        )
        assert standing.of("F") > 0
        if how == "failed call":
            bans.record_failure("F", clock.now)
        else:
            bans.ban_liar("F", clock.now)
        _look(standing, records, bans=bans, contradictions=contradictions)
        assert standing.of("F") == 0, how
        assert standing.of("A") > 0
        # Its record stays, its ban (1 s for one failure) ends: still nothing for a while.
        _serve_for(
            standing, clock, CONTRADICTION_S - 10, records, bans=bans, contradictions=contradictions
        )
        assert standing.of("F") == 0, how
        assert "F" not in standing.standings()


def test_an_unreachable_peer_earns_nothing() -> None:
    clock = Clock()
    standing = Standing(clock=clock)
    records = [make_record("A", 0, 10), make_record("U", 10, 20)]
    _serve_for(standing, clock, QUALIFY_S * 2, records, missed=frozenset({"U"}))
    assert standing.of("A") > 0 and standing.of("U") == 0


def test_standing_decays_to_nothing_within_the_decay_period_after_serving_stops() -> None:
    clock = Clock()
    standing = Standing(clock=clock)
    priority = Priority(standing, clock=clock)
    records = [make_record("A", 0, 10), make_record("B", 10, 30)]
    _serve_for(standing, clock, 600, records)
    full = standing.of("B")
    assert full > 0
    assert priority.order(["taker", "B"], owner=str) == ["B", "taker"]
    stopped = clock.now
    _serve_for(standing, clock, DECAY_S / 2, records[:1])  # B's record is gone
    assert standing.of("B") == pytest.approx(full / 2, rel=0.1)
    clock.now = stopped + DECAY_S
    _look(standing, records[:1])
    assert standing.of("B") == 0
    assert priority.order(["taker", "B"], owner=str) == ["taker", "B"]  # no priority left
    # Serving again starts a new stretch: it must qualify again.
    _look(standing, records)
    assert standing.of("B") == 0


def _busy_priority(clock: Clock, standings: dict[str, float], turns: int) -> dict[str, float]:
    """Work each peer gets when all of them always wait and each turn is one token."""
    standing = Standing(num_blocks=NUM_BLOCKS, qualify_s=0, clock=clock)
    for peer, share in standings.items():
        standing.saw_serving(peer, round(share * NUM_BLOCKS), speed=1.0 / 0.5)
    priority = Priority(standing, clock=clock)
    work = dict.fromkeys([*standings, "taker1", "taker2"], 0.0)
    for _ in range(turns):
        first = priority.order(list(work), owner=str)[0]
        priority.account(first, 1)
        work[first] += 1
        clock.now += 0.01
    return work


def test_takers_keep_their_share_and_contributors_share_by_standing() -> None:
    clock = Clock()
    work = _busy_priority(clock, {"C1": 0.1, "C2": 0.2}, turns=3000)
    total = sum(work.values())
    takers = (work["taker1"] + work["taker2"]) / total
    assert takers == pytest.approx(TAKER_SHARE, abs=0.02)
    assert work["C2"] / work["C1"] == pytest.approx(2.0, rel=0.1)


def test_fifo_keeps_the_callers_order_and_still_counts() -> None:
    clock = Clock()
    standing = Standing(num_blocks=NUM_BLOCKS, qualify_s=0, clock=clock)
    standing.saw_serving("C", 10, 1.0)
    priority = Priority(standing, enabled=False, clock=clock)
    assert priority.order(["t", "C"], owner=str) == ["t", "C"]
    priority.account("C", 3)
    priority.account("t", 1)
    assert priority.contributor_share() == pytest.approx(0.75)


# --- a real batcher and admission queue ----------------------------------------------------


@pytest.fixture(scope="module")
def span(tmp_path_factory: pytest.TempPathFactory) -> blocks.Span:
    path: Path = save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return blocks.load_span(path, 0, 3)


def _contributor_priority(enabled: bool = True) -> Priority:
    standing = Standing(num_blocks=NUM_BLOCKS, qualify_s=0)
    standing.saw_serving("contributor", 10, 1.0)
    return Priority(standing, enabled=enabled)


@pytest.mark.parametrize("enabled", [True, False], ids=["standing", "fifo"])
async def test_the_batcher_runs_a_contributors_step_before_a_takers(
    span: blocks.Span, enabled: bool
) -> None:
    """A taker's long prefill and a contributor's decode step wait together: by standing, the
    contributor's step runs first; fifo keeps arrival order (the prefill, then the step)."""
    cache = MemoryCache(budget_tokens=10_000)
    batcher = StepBatcher(ComputeQueue(), priority=_contributor_priority(enabled))
    taker, contributor = cache.open_session(1, 64), cache.open_session(1, 64)
    done: list[str] = []
    span.chunk_tokens = 64  # the prefill in one turn

    async def run(owner: str, session: SpanSession, tokens: int) -> None:
        await batcher.run(span, session, torch.randn(1, tokens, 32), owner=owner)
        done.append(owner)

    gate = threading.Event()
    try:
        async with trio.open_nursery() as nursery:
            # Hold the device until both steps wait for it.
            nursery.start_soon(batcher.compute.run, 0, gate.wait)
            while not batcher.compute.depth:
                await trio.sleep(0.001)
            nursery.start_soon(run, "taker", taker, 40)
            while not batcher._waiting:
                await trio.sleep(0.001)
            nursery.start_soon(run, "contributor", contributor, 1)
            while len(batcher._waiting) < 2:
                await trio.sleep(0.001)
            gate.set()
    finally:
        span.chunk_tokens = blocks.span.PREFILL_CHUNK_TOKENS
    assert done == (["contributor", "taker"] if enabled else ["taker", "contributor"])


@pytest.mark.parametrize(
    ("enabled", "busy", "forwards"),
    [(True, True, 4), (True, False, 1), (False, True, 1)],
    ids=["standing-busy", "standing-alone", "fifo-busy"],
)
async def test_by_standing_a_long_prefill_runs_in_short_turns_while_others_use_the_server(
    span: blocks.Span, enabled: bool, busy: bool, forwards: int
) -> None:
    """A contributor's step cannot preempt a turn under way: by standing, while another
    peer stepped lately, turns of a long step are PRIORITY_TURN_TOKENS long; alone on the server (or
    fifo) it runs a whole chunk at once. The same result either way."""
    cache = MemoryCache(budget_tokens=10_000)
    prompt = torch.randn(1, 3 * PRIORITY_TURN_TOKENS + 8, 32)
    assert span.chunk_tokens >= prompt.shape[1]
    with cache.open_session(1, 256) as reference:
        want = span(prompt, reference)
    batcher = StepBatcher(ComputeQueue(), priority=_contributor_priority(enabled))
    with cache.open_session(1, 256) as session, cache.open_session(1, 8) as other:
        if busy:  # another peer's session stepped just now
            await batcher.run(span, other, torch.randn(1, 1, 32), owner="other")
        before = batcher.counters.forwards
        got = await batcher.run(span, session, prompt, owner="taker")
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert batcher.counters.forwards - before == forwards


async def test_the_admission_queue_admits_a_contributor_before_an_earlier_taker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=100)
    admission = Admission(
        max_sessions_per_peer=4,
        max_inflight_bytes_per_peer=100,
        priority=_contributor_priority(),
    )
    held = cache.open_session(1, 80)
    order: list[str] = []
    opened: list[SpanSession] = []

    async def ask(peer: str) -> None:
        opened.append(await admission.open_session(cache, 1, 60, wait_s=30, peer=peer))
        order.append(peer)
        await trio.sleep(5)
        opened[-1].close()
        admission.cache_freed()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "taker")
        await trio.sleep(1)
        nursery.start_soon(ask, "contributor")
        await trio.sleep(1)
        assert admission.queued == 2
        held.close()
        admission.cache_freed()
    assert order == ["contributor", "taker"]


def test_metrics_show_the_share_of_work_given_to_contributors() -> None:
    server = BlockServer(
        model=MODEL, start=0, end=1, compute=ComputeQueue(), peer_id="me", addrs=list
    )
    server.standing.num_blocks = NUM_BLOCKS
    server.standing.qualify_s = 0
    server.standing.saw_serving("C", 10, 1.0)
    server.batcher.priority.account("C", 30)  # type: ignore[union-attr]
    server.batcher.priority.account("taker", 10)  # type: ignore[union-attr]
    text = render(_standing(server))
    assert 'peerd_contributor_work_share{queue="turns"} 0.75' in text
    assert 'peerd_priority_work_total{class="taker",queue="turns"} 10' in text
    assert "peerd_contributors 1" in text
