"""A swarm of thousands of synthetic servers on an 80-block model, joining, leaving, rebalancing.

Seeded, so every run sees the same swarm. Measured over seeds 0-9: min/max per-block capacity
0.83-0.95 after 2,000 joins; after the departures below and rebalancing, 0.65-0.71 within 2-3
rounds (seeds 1, 2, 3, 7), the weakest block 50-1000 times faster than right after they left.
"""

from __future__ import annotations

import itertools
import random

import pytest

from routing.bans import BanList
from routing.block_selection import better_span, blocks_that_fit, choose_blocks
from routing.planner import plan_route
from routing.records import SwarmSnapshot
from routing.rtt import RttTracker
from tests.test_routing_fixtures import make_record, make_snapshot

NUM_BLOCKS = 80  # a 70B-class model
GIB = 2**30
# Per block: fp16 weights of a 70B-class layer, and KV cache room for a few sessions.
BLOCK_BYTES = int(1.7 * GIB)
CACHE_BYTES = int(0.3 * GIB)
GPU_MEMORY_GIB = [4, 6, 8, 12, 16, 24, 24, 40, 48, 80]


def ratio(snap: SwarmSnapshot) -> float:
    throughputs = snap.block_throughputs()
    return min(throughputs) / max(throughputs)


def join_swarm(count: int, rng: random.Random) -> SwarmSnapshot:
    """`count` volunteers join one after another, each with `choose_blocks`."""
    snap = make_snapshot(NUM_BLOCKS)
    for i in range(count):
        memory = rng.choice(GPU_MEMORY_GIB) * GIB * 8 // 10  # leave room for activations
        num_blocks = blocks_that_fit(memory, BLOCK_BYTES, CACHE_BYTES, NUM_BLOCKS)
        # A device runs some block-tokens/s; over a span of n blocks that is 1/n as many tokens/s.
        throughput = rng.lognormvariate(7.0, 0.6) / num_blocks
        span = choose_blocks(snap, num_blocks, throughput)
        snap = snap.with_record(
            make_record(f"peer{i:05d}", *span, throughput=throughput, relayed=rng.random() < 0.2)
        )
    return snap


def rebalance(
    snap: SwarmSnapshot, rng: random.Random, max_rounds: int
) -> tuple[SwarmSnapshot, int]:
    """Every server re-checks with `better_span`, in random order, until nobody moves."""
    for round_number in range(1, max_rounds + 1):
        moved = 0
        order = [r.peer_id for r in snap.records]
        rng.shuffle(order)
        for peer_id in order:
            record = snap.record(peer_id)
            assert record is not None
            span = better_span(snap, record)
            if span is not None:
                snap = snap.with_record(make_record(peer_id, *span, record.throughput))
                moved += 1
        if not moved:
            return snap, round_number
    pytest.fail(f"servers still moving after {max_rounds} rounds")


@pytest.mark.parametrize("seed", [1, 2])
def test_two_thousand_joining_servers_cover_every_block_evenly(seed: int) -> None:
    rng = random.Random(seed)
    snap = join_swarm(2000, rng)
    assert snap.uncovered_blocks() == ()
    assert ratio(snap) >= 0.8

    # Plan over the whole swarm as a client would: RTTs measured for some peers, a few bans.
    rtts = RttTracker()
    for record in rng.sample(snap.records, 300):
        for _ in range(3):
            rtts.record(record.peer_id, rng.uniform(0.005, 0.3))
    bans = BanList()
    for record in rng.sample(snap.records, 50):
        bans.record_failure(record.peer_id, now=0.0)
    for mode in ("inference", "training"):
        route = plan_route(
            snap,
            rtts=rtts,
            bans=bans,
            now=0.5,
            min_free_cache_tokens=1024,
            mode=mode,  # type: ignore[arg-type]
            rng=rng,
        )
        assert route[0].start == 0 and route[-1].end == NUM_BLOCKS
        assert all(a.end == b.start for a, b in itertools.pairwise(route))
        assert not any(bans.is_banned(hop.peer_id, 0.5) for hop in route)


def test_a_swarm_heals_after_a_third_of_it_leaves() -> None:
    rng = random.Random(7)
    snap = join_swarm(1000, rng)
    # Everyone whose span starts in blocks 20-49 leaves at once (a region's volunteers go home).
    survivors = tuple(r for r in snap.records if not 20 <= r.start < 50)
    snap = SwarmSnapshot(snap.model, NUM_BLOCKS, survivors)
    assert len(survivors) < 700
    weakest_before = min(snap.block_throughputs())

    snap, rounds = rebalance(snap, rng, max_rounds=20)
    assert snap.uncovered_blocks() == ()
    assert min(snap.block_throughputs()) > 20 * weakest_before
    assert ratio(snap) >= 0.5
    assert rounds <= 5
    # Settled: nobody would move again.
    assert all(better_span(snap, r) is None for r in snap.records)
