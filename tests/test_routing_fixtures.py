"""Builders and hypothesis strategies shared by the routing tests (no tests of its own)."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from routing.records import ServerRecord, ServerState, SwarmSnapshot

MODEL = "smollm2-135m"

# The test machines are shared and busy: a slow example is load, not a bug in the code under test.
relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_record(
    peer_id: str,
    start: int,
    end: int,
    throughput: float = 10.0,
    **changes: Any,
) -> ServerRecord:
    """An online, direct record with plenty of cache unless `changes` says otherwise."""
    fields: dict[str, Any] = {
        "peer_id": peer_id,
        "model": MODEL,
        "start": start,
        "end": end,
        "throughput": throughput,
        "free_cache_tokens": 4096,
        "state": ServerState.ONLINE,
        "version": "0.1.0",
        "addrs": (f"/ip4/10.0.0.1/tcp/4001/p2p/{peer_id}",),
        "relayed": False,
    }
    fields.update(changes)
    return ServerRecord(**fields)


def make_snapshot(num_blocks: int, *records: ServerRecord) -> SwarmSnapshot:
    return SwarmSnapshot(MODEL, num_blocks, tuple(records))


@st.composite
def swarms(draw: st.DrawFn, *, max_blocks: int = 16, max_servers: int = 12) -> SwarmSnapshot:
    """Small random swarms: any spans, throughputs (some zero), states, relays and cache."""
    num_blocks = draw(st.integers(1, max_blocks))
    count = draw(st.integers(0, max_servers))
    records = []
    for i in range(count):
        start = draw(st.integers(0, num_blocks - 1))
        end = draw(st.integers(start + 1, min(num_blocks, start + draw(st.integers(1, 8)))))
        records.append(
            make_record(
                f"peer{i:02d}",
                start,
                end,
                throughput=draw(st.sampled_from([0.0, 1.0, 2.5, 10.0, 40.0])),
                # Mostly usable servers, so that routes of several hops come up often.
                state=draw(st.sampled_from([*ServerState, ServerState.ONLINE, ServerState.ONLINE])),
                relayed=draw(st.booleans()),
                free_cache_tokens=draw(st.sampled_from([0, 100, 4096, 4096])),
            )
        )
    if draw(st.booleans()):
        # A backbone of online servers end to end, so that half the swarms have routes of
        # several hops for the extras above to compete with.
        cuts = draw(st.sets(st.integers(1, max(1, num_blocks - 1)), max_size=4)) - {num_blocks}
        bounds = [0, *sorted(cuts), num_blocks]
        for j, (start, end) in enumerate(itertools.pairwise(bounds)):
            throughput = draw(st.sampled_from([1.0, 2.5, 10.0, 40.0]))
            records.append(make_record(f"spine{j}", start, end, throughput=throughput))
    return make_snapshot(num_blocks, *records)
