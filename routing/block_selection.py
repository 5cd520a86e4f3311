"""Block selection: which contiguous span of blocks a server should hold, and when to move.

Every function here is pure over a `SwarmSnapshot`. A server counts the swarm's capacity per
block (the summed throughput, in tokens/s, of the joining and online servers holding it) and
takes the window of blocks the swarm serves worst:

1. the window that covers the most blocks nobody holds (a hole stops every generation);
2. then the window that leaves the swarm's bottleneck (its least-served block) highest once this
   server's own throughput is added;
3. then the window whose per-block capacities, sorted ascending, are lexicographically smallest
   (its weakest block is weakest, then its second weakest, ...);
4. then the lowest start, so equal swarms always give equal answers.

Other servers' throughputs are self-reported, so they count only as far as routing believes
them (routing.speeds.believed_snapshot: at most 4 times the swarm's median speed per block): a
record announcing 1e300 tokens/s would otherwise make every other server leave its blocks.

A running server re-checks now and then (`recheck_delay`) and moves (`better_span`) only when
that clearly helps the blocks it would leave and join, so servers do not chase noise.
"""

from __future__ import annotations

import math
import random

from routing.records import SELECTION_STATES, ServerRecord, SwarmSnapshot
from routing.speeds import believed_snapshot
from wire import ServerState

# A move drains sessions and reloads weights, minutes of lost service; only make it when the
# weakest affected block gains at least 20%. Below that, throughput measurements are noise.
DEFAULT_MIN_IMPROVEMENT = 1.2
# Relative differences below this are rounding, not capacity: believed throughputs (a cap divided
# by a span length) are rarely exact in binary, and a move must not chase their crumbs.
_FLOAT_NOISE = 1e-9
# Re-check about every 2 minutes per server (with jitter): fast enough to fill a hole left by a
# departing server before users notice, slow enough that DHT lookups stay a trickle.
DEFAULT_RECHECK_PERIOD_S = 120.0
# Spread re-checks over +-50% of the period so servers that started together do not all move
# into the same hole at the same moment.
DEFAULT_RECHECK_JITTER = 0.5


def choose_blocks(
    snapshot: SwarmSnapshot, num_blocks_to_serve: int, own_throughput: float
) -> tuple[int, int]:
    """The span (start, end) a server with `own_throughput` tokens/s should serve.

    Joining servers count as holding their span (see `SELECTION_STATES`); draining ones do not.
    A request for more blocks than the model has gets the whole model.
    """
    if num_blocks_to_serve < 1:
        raise ValueError(f"num_blocks_to_serve must be >= 1, got {num_blocks_to_serve}")
    if not (math.isfinite(own_throughput) and own_throughput >= 0):
        raise ValueError(f"own_throughput must be finite and >= 0, got {own_throughput!r}")
    return _choose(believed_snapshot(snapshot), num_blocks_to_serve, own_throughput)


def _choose(
    snapshot: SwarmSnapshot, num_blocks_to_serve: int, own_throughput: float
) -> tuple[int, int]:
    """choose_blocks over throughputs already believed."""
    throughputs, counts = snapshot.coverage(states=SELECTION_STATES)
    num_blocks = snapshot.num_blocks
    width = min(num_blocks_to_serve, num_blocks)

    # Bottleneck outside each window, from prefix and suffix minima: O(blocks) for all windows.
    prefix_min = [math.inf] * (num_blocks + 1)
    for block in range(num_blocks):
        prefix_min[block + 1] = min(prefix_min[block], throughputs[block])
    suffix_min = [math.inf] * (num_blocks + 1)
    for block in range(num_blocks - 1, -1, -1):
        suffix_min[block] = min(suffix_min[block + 1], throughputs[block])

    def weakness(start: int) -> tuple[int, float, list[float]]:
        """Smaller is weaker, i.e. a better place to serve (see the module docstring)."""
        end = start + width
        window = sorted(throughputs[start:end])
        holes = sum(1 for count in counts[start:end] if count == 0)
        bottleneck_after = min(prefix_min[start], suffix_min[end], window[0] + own_throughput)
        return (-holes, -bottleneck_after, window)

    # min() keeps the first of equal keys: the lowest start wins ties.
    start = min(range(num_blocks - width + 1), key=weakness)
    return (start, start + width)


def better_span(
    snapshot: SwarmSnapshot,
    my_record: ServerRecord,
    *,
    min_improvement: float = DEFAULT_MIN_IMPROVEMENT,
) -> tuple[int, int] | None:
    """The span this server should move to, or None to stay where it is.

    The server takes itself out of the swarm and chooses again as if joining. Then it looks only
    at the blocks the move touches: those it would leave and those it would join, counting the
    other servers' capacity on each. It moves when

    - the move leaves fewer of those blocks unserved; or, with none unserved either way,
    - the weakest of them gets more than `min_improvement` times faster (a big server filling a
      weak spot), or
    - the blocks it leaves stay more than `min_improvement` times better served than the blocks
      it joins, even with it there (a small server in a big swarm: no single move of it can lift
      a block by 20%, but a surplus this large means it is in the wrong place).

    Either way the weakest touched block gets strictly faster, so every move improves the
    swarm's sorted per-block capacity and servers that follow this rule one at a time settle
    instead of oscillating. A server that has not measured its throughput (0) only moves to fill
    holes.
    """
    if not min_improvement >= 1:
        raise ValueError(f"min_improvement must be >= 1, got {min_improvement!r}")
    # Believed once, over the whole swarm (this server too), so that the median stays put
    # while servers move and each move improves the swarm as selection sees it.
    believed = believed_snapshot(snapshot.with_record(my_record))
    own = believed.by_peer[my_record.peer_id].throughput
    others = believed.without(my_record.peer_id)
    candidate = _choose(others, my_record.num_blocks, own)
    if candidate == my_record.span:
        return None

    throughputs, counts = others.coverage(states=SELECTION_STATES)
    # Same width, different start: both lists are non-empty.
    leaving = [b for b in range(*my_record.span) if not candidate[0] <= b < candidate[1]]
    joining = [b for b in range(*candidate) if not my_record.start <= b < my_record.end]
    holes_opened = sum(1 for b in leaving if counts[b] == 0)
    holes_filled = sum(1 for b in joining if counts[b] == 0)
    if holes_filled != holes_opened:
        return candidate if holes_filled > holes_opened else None
    if holes_filled or own <= 0:
        return None  # a hole for a hole, or no capacity to move: nothing gained

    left = min(throughputs[b] for b in leaving)
    joined = min(throughputs[b] for b in joining)
    weakest_now = min(left + own, joined)
    weakest_moved = min(left, joined + own)
    bar = min_improvement * (1 + _FLOAT_NOISE)
    if weakest_moved > bar * weakest_now or left > bar * weakest_moved:
        return candidate
    return None


def should_move(
    snapshot: SwarmSnapshot,
    my_record: ServerRecord,
    *,
    min_improvement: float = DEFAULT_MIN_IMPROVEMENT,
) -> bool:
    """Whether `better_span` would move this server."""
    return better_span(snapshot, my_record, min_improvement=min_improvement) is not None


def first_to_move(
    snapshot: SwarmSnapshot,
    my_record: ServerRecord,
    target: tuple[int, int],
    *,
    min_improvement: float = DEFAULT_MIN_IMPROVEMENT,
) -> str:
    """The peer id of the server that should make the move to `target` first: of the online
    servers holding the same span as this one (itself included) that `better_span` would send
    to `target`, the lowest peer id. Servers that see the same gap decide within a refresh of
    each other, before either one's move can show; without an order they all move, each sees
    the span they left empty, and they all move back (seen with two servers of 0:10 and a gap
    at 10:20, for over a minute)."""
    movers = [my_record.peer_id]
    for record in snapshot.records:
        if record.peer_id == my_record.peer_id or record.span != my_record.span:
            continue
        if record.state is not ServerState.ONLINE:
            continue
        if better_span(snapshot, record, min_improvement=min_improvement) == target:
            movers.append(record.peer_id)
    return min(movers)


def recheck_delay(
    rng: random.Random,
    period_s: float = DEFAULT_RECHECK_PERIOD_S,
    *,
    jitter: float = DEFAULT_RECHECK_JITTER,
) -> float:
    """Seconds until the next `better_span` check: `period_s` give or take `jitter` of it."""
    if not (math.isfinite(period_s) and period_s > 0):
        raise ValueError(f"period_s must be finite and > 0, got {period_s!r}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
    return period_s * rng.uniform(1 - jitter, 1 + jitter)


def blocks_that_fit(
    memory_budget_bytes: int,
    bytes_per_block: int,
    cache_bytes_per_block: int,
    num_blocks: int,
) -> int:
    """How many blocks fit in `memory_budget_bytes`, each with its weights and KV cache.

    Capped at the model's `num_blocks`; 0 when not even one block fits.
    """
    if memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes must be >= 0, got {memory_budget_bytes}")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    if cache_bytes_per_block < 0:
        raise ValueError(f"cache_bytes_per_block must be >= 0, got {cache_bytes_per_block}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return min(num_blocks, memory_budget_bytes // (bytes_per_block + cache_bytes_per_block))
