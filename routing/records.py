"""Server records and swarm snapshots: what routing knows about who serves which blocks.

A `ServerRecord` is one server's announcement for one model: its span of blocks, how fast it
runs them, how much KV cache it has left, its lifecycle state and how to reach it. Records travel
over the wire as plain maps (`to_dict` / `from_dict`), so `from_dict` treats its input as
untrusted and turns every malformed field into a `ValueError` that names the field.

A `SwarmSnapshot` freezes the records for one model at one moment; block selection and route
planning are pure functions of it.

Throughput unit: `ServerRecord.throughput` is the number of decode-step tokens per second the
server sustains through its *whole* span [start, end), as the server measured it (the lesser of
its compute and network capacity). One token therefore spends `1 / throughput` seconds in the
span, and `1 / (throughput * num_blocks)` seconds per block. A server adds its full `throughput`
to every block it holds when the swarm's per-block capacity is summed, because every token that
passes through the span passes through each of its blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import wire
from wire import ServerState

# Servers a route may use: a joining server cannot compute yet, a draining one refuses new work.
ROUTABLE_STATES: frozenset[ServerState] = frozenset({ServerState.ONLINE})
# Servers block selection counts as holding their span: a joining server will hold it in a
# minute, and ignoring it would send every server that starts at the same time to the same blocks.
SELECTION_STATES: frozenset[ServerState] = frozenset({ServerState.JOINING, ServerState.ONLINE})


@wire.record
class ServerRecord(wire.ServerInfo):
    """One server's announcement as routing keeps it: the wire's ServerInfo (its fields, and their
    checks, are declared there once), and when it was made and stops being valid.

    throughput: decode-step tokens/s through the whole span (see the module docstring).
    free_cache_tokens: tokens of KV cache the server can still give a new session for its whole
        span; a route for inference skips servers with less than the session needs.
    relayed: the server is reachable only through a circuit relay, which costs an extra hop.
    max_session_length: a route skips a server whose limit (0: not announced) is below the
        session's.
    updated_at / expires_at: seconds on the announcer's clock when the record was made and when
        it stops being valid unless refreshed (`math.inf`: no expiry known). Not sent in a
        ServerInfo (record_to_info): clocks differ, so expiry is the receiver's business.

    Every check raises ValueError naming the bad field, whether the record is built here or
    parsed from a peer's map (`from_dict`).
    """

    updated_at: float = wire.spec(default=0.0, allow_nonfinite=True)
    expires_at: float = wire.spec(default=math.inf, allow_nonfinite=True)

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except wire.MalformedMessage as error:
            raise ValueError(f"bad {_whose(self.peer_id)}: {error}") from None

    def check(self) -> None:
        super().check()
        for name in ("updated_at", "expires_at"):
            if math.isnan(getattr(self, name)):
                raise ValueError(f"{name} must not be NaN")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServerRecord:
        """Parse a map from the wire; raise ValueError naming the first bad field.

        Unknown keys are ignored so that a newer peer can add fields without breaking older ones.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"bad server record: expected a map, got {type(d).__name__}")
        try:
            return super().from_dict(d)
        except wire.MalformedMessage as error:
            raise ValueError(f"bad {_whose(d.get('peer_id'))}: {error}") from None

    # Hashable, unlike wire records (which may hold tensors): routes hold records and may be
    # used as keys. Equal records have the same peer, span and time.
    def __hash__(self) -> int:  # type: ignore[override]
        return hash((self.peer_id, self.start, self.end, self.updated_at))

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def seconds_per_block(self) -> float:
        """Time one decode-step token spends in one of this server's blocks (inf if stalled)."""
        if self.throughput <= 0:
            return math.inf
        return 1.0 / (self.throughput * self.num_blocks)

    def covers(self, block: int) -> bool:
        return self.start <= block < self.end

    def is_expired(self, now: float) -> bool:
        return now >= self.expires_at


def _whose(peer_id: object) -> str:
    return f"server record of peer {peer_id!r}" if isinstance(peer_id, str) else "server record"


def contiguous_ranges(blocks: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Group block indices into sorted half-open runs: [1, 2, 3, 7] -> ((1, 4), (7, 8))."""
    ranges: list[tuple[int, int]] = []
    for block in sorted(set(blocks)):
        if ranges and ranges[-1][1] == block:
            ranges[-1] = (ranges[-1][0], block + 1)
        else:
            ranges.append((block, block + 1))
    return tuple(ranges)


def format_blocks(start: int, end: int) -> str:
    """Blocks [start, end) as a person reads them: 'block 3' or 'blocks 12-17' (inclusive)."""
    return f"block {start}" if end - start == 1 else f"blocks {start}-{end - 1}"


@dataclass(frozen=True)
class SwarmSnapshot:
    """The records of every known server of one model with `num_blocks` blocks, frozen.

    The constructor checks consistency and raises ValueError; `from_records` instead drops what
    does not belong (other models, spans past the end, expired records, stale duplicates), which
    is what a caller holding raw DHT results wants.
    """

    model: str
    num_blocks: int
    records: tuple[ServerRecord, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"a swarm needs num_blocks >= 1, got {self.num_blocks!r}")
        seen: set[str] = set()
        for record in self.records:
            if record.model != self.model:
                raise ValueError(
                    f"record of peer {record.peer_id!r} is for model {record.model!r}, "
                    f"not {self.model!r}"
                )
            if record.end > self.num_blocks:
                raise ValueError(
                    f"record of peer {record.peer_id!r} spans [{record.start}, {record.end}) "
                    f"but {self.model} has only {self.num_blocks} blocks"
                )
            if record.peer_id in seen:
                raise ValueError(f"two records for peer {record.peer_id!r}")
            seen.add(record.peer_id)

    @classmethod
    def from_records(
        cls,
        model: str,
        num_blocks: int,
        records: Iterable[ServerRecord],
        *,
        now: float | None = None,
    ) -> SwarmSnapshot:
        """Keep the usable records: this model, inside the model, unexpired, newest per peer."""
        newest: dict[str, ServerRecord] = {}
        for record in records:
            if record.model != model or record.end > num_blocks:
                continue
            if now is not None and record.is_expired(now):
                continue
            kept = newest.get(record.peer_id)
            if kept is None or record.updated_at > kept.updated_at:
                newest[record.peer_id] = record
        return cls(model, num_blocks, tuple(newest.values()))

    @cached_property
    def by_peer(self) -> Mapping[str, ServerRecord]:
        return {record.peer_id: record for record in self.records}

    def record(self, peer_id: str) -> ServerRecord | None:
        return self.by_peer.get(peer_id)

    def with_record(self, record: ServerRecord) -> SwarmSnapshot:
        """This snapshot with `record` added, or replacing the record of the same peer."""
        others = tuple(r for r in self.records if r.peer_id != record.peer_id)
        return SwarmSnapshot(self.model, self.num_blocks, (*others, record))

    def without(self, peer_id: str) -> SwarmSnapshot:
        return SwarmSnapshot(
            self.model, self.num_blocks, tuple(r for r in self.records if r.peer_id != peer_id)
        )

    def servers_covering(
        self, block: int, *, states: Iterable[ServerState] | None = None
    ) -> tuple[ServerRecord, ...]:
        """Records whose span holds `block`, in any state unless `states` narrows it."""
        self._check_block(block)
        wanted = None if states is None else frozenset(states)
        return tuple(
            r for r in self.records if r.covers(block) and (wanted is None or r.state in wanted)
        )

    def block_throughputs(
        self, *, states: Iterable[ServerState] = ROUTABLE_STATES
    ) -> tuple[float, ...]:
        """Per block, the summed throughput (tokens/s) of the servers in `states` holding it."""
        return self.coverage(states=states)[0]

    def block_server_counts(
        self, *, states: Iterable[ServerState] = ROUTABLE_STATES
    ) -> tuple[int, ...]:
        """Per block, how many servers in `states` hold it."""
        return self.coverage(states=states)[1]

    def uncovered_blocks(
        self, *, states: Iterable[ServerState] = ROUTABLE_STATES
    ) -> tuple[int, ...]:
        """Blocks no server in `states` holds, ascending."""
        counts = self.block_server_counts(states=states)
        return tuple(block for block, count in enumerate(counts) if count == 0)

    def coverage(
        self, *, states: Iterable[ServerState] = ROUTABLE_STATES
    ) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """`block_throughputs` and `block_server_counts` together, in one pass over the records."""
        states = frozenset(states)
        # Difference arrays: O(records + blocks), not O(records * span), since simulations ask
        # this once per joining server over thousands of records.
        throughput_delta = [0.0] * (self.num_blocks + 1)
        count_delta = [0] * (self.num_blocks + 1)
        for r in self.records:
            if r.state in states:
                throughput_delta[r.start] += r.throughput
                throughput_delta[r.end] -= r.throughput
                count_delta[r.start] += 1
                count_delta[r.end] -= 1
        throughputs: list[float] = []
        counts: list[int] = []
        running_throughput, running_count = 0.0, 0
        for block in range(self.num_blocks):
            running_count += count_delta[block]
            counts.append(running_count)
            # Summing deltas can leave a float crumb like 1e-13 on a block nobody holds.
            running_throughput += throughput_delta[block]
            throughputs.append(running_throughput if running_count else 0.0)
        return tuple(throughputs), tuple(counts)

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(
                f"block {block} is outside {self.model}'s blocks 0-{self.num_blocks - 1}"
            )


def record_to_info(record: ServerRecord) -> wire.ServerInfo:
    """Our record as the wire's ServerInfo (expiry is the receiver's business: clocks differ)."""
    return wire.ServerInfo.from_dict(record.to_dict())  # from_dict leaves out the record's own


def info_to_record(info: wire.ServerInfo) -> ServerRecord:
    """A received ServerInfo as a routing record; ValueError if it does not make sense."""
    return ServerRecord.from_dict(info.to_dict())
