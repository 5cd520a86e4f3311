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

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import wire


class ServerState(enum.StrEnum):
    """Where a server is in its life; only `ONLINE` servers take new sessions."""

    JOINING = "joining"  # announced its span, still loading weights or measuring throughput
    ONLINE = "online"
    DRAINING = "draining"  # finishing open sessions before it leaves or moves; takes no new ones


# Servers a route may use: a joining server cannot compute yet, a draining one refuses new work.
ROUTABLE_STATES: frozenset[ServerState] = frozenset({ServerState.ONLINE})
# Servers block selection counts as holding their span: a joining server will hold it in a
# minute, and ignoring it would send every server that starts at the same time to the same blocks.
SELECTION_STATES: frozenset[ServerState] = frozenset({ServerState.JOINING, ServerState.ONLINE})


@dataclass(frozen=True)
class ServerRecord:
    """One server's announcement: it serves blocks [start, end) of `model`.

    throughput: decode-step tokens/s through the whole span (see the module docstring).
    free_cache_tokens: tokens of KV cache the server can still give a new session for its whole
        span; a route for inference skips servers with less than the session needs.
    relayed: the server is reachable only through a circuit relay, which costs an extra hop.
    max_session_length, max_sessions_per_peer, max_inflight_bytes_per_peer: the server's
        admission limits (0: not announced); a route skips a server whose max_session_length is
        below the session's.
    queued_sessions: sessions waiting there for cache now.
    swarm: the private swarm the server belongs to ("" for the public one).
    updated_at / expires_at: seconds on the announcer's clock when the record was made and when
        it stops being valid unless refreshed (`math.inf`: no expiry known).
    """

    peer_id: str
    model: str
    start: int
    end: int
    throughput: float
    free_cache_tokens: int
    state: ServerState
    version: str
    addrs: tuple[str, ...]
    relayed: bool
    adapters: tuple[str, ...] = ()
    max_session_length: int = 0
    max_sessions_per_peer: int = 0
    max_inflight_bytes_per_peer: int = 0
    queued_sessions: int = 0
    swarm: str = ""
    updated_at: float = 0.0
    expires_at: float = math.inf

    def __post_init__(self) -> None:
        who = "server record"
        if isinstance(self.peer_id, str):
            who = f"server record of peer {self.peer_id!r}"
        _check_str(who, "peer_id", self.peer_id, nonempty=True)
        _check_str(who, "model", self.model, nonempty=True)
        _check_int(who, "start", self.start)
        _check_int(who, "end", self.end)
        if not 0 <= self.start < self.end:
            raise ValueError(
                f"bad {who}: span [{self.start}, {self.end}) must satisfy 0 <= start < end"
            )
        _check_number(who, "throughput", self.throughput)
        if not math.isfinite(self.throughput) or self.throughput < 0:
            raise ValueError(
                f"bad {who}: throughput must be a finite number >= 0 tokens/s, "
                f"got {self.throughput!r}"
            )
        _check_int(who, "free_cache_tokens", self.free_cache_tokens)
        if self.free_cache_tokens < 0:
            raise ValueError(
                f"bad {who}: free_cache_tokens must be >= 0, got {self.free_cache_tokens}"
            )
        if not isinstance(self.state, ServerState):
            raise ValueError(
                f"bad {who}: state must be a ServerState, got {type(self.state).__name__}"
            )
        _check_str(who, "version", self.version)
        _check_str(who, "swarm", self.swarm)
        _check_str_tuple(who, "addrs", self.addrs)
        if not isinstance(self.relayed, bool):
            raise ValueError(f"bad {who}: relayed must be a bool, got {_kind(self.relayed)}")
        _check_str_tuple(who, "adapters", self.adapters)
        for name in _LIMIT_FIELDS:
            _check_int(who, name, getattr(self, name))
            if getattr(self, name) < 0:
                raise ValueError(f"bad {who}: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("updated_at", "expires_at"):
            value = getattr(self, name)
            _check_number(who, name, value)
            if math.isnan(value):
                raise ValueError(f"bad {who}: {name} must not be NaN")

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

    def to_dict(self) -> dict[str, Any]:
        """A plain map of str, int, float, bool and lists, ready for msgpack."""
        return {
            "peer_id": self.peer_id,
            "model": self.model,
            "start": self.start,
            "end": self.end,
            "throughput": float(self.throughput),
            "free_cache_tokens": self.free_cache_tokens,
            "state": self.state.value,
            "version": self.version,
            "addrs": list(self.addrs),
            "relayed": self.relayed,
            "adapters": list(self.adapters),
            **{name: getattr(self, name) for name in _LIMIT_FIELDS},
            "swarm": self.swarm,
            "updated_at": float(self.updated_at),
            "expires_at": float(self.expires_at),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServerRecord:
        """Parse a map from the wire; raise ValueError naming the first bad field.

        Unknown keys are ignored so that a newer peer can add fields without breaking older ones.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"bad server record: expected a map, got {_kind(d)}")
        missing = [name for name in _REQUIRED_FIELDS if name not in d]
        if missing:
            raise ValueError(f"bad server record: missing field(s) {', '.join(missing)}")
        kwargs: dict[str, Any] = {name: d[name] for name in _ALL_FIELDS if name in d}
        for name in ("addrs", "adapters"):
            if name in kwargs and isinstance(kwargs[name], list):
                kwargs[name] = tuple(kwargs[name])
        state = kwargs["state"]
        if isinstance(state, str) and not isinstance(state, ServerState):
            try:
                kwargs["state"] = ServerState(state)
            except ValueError:
                allowed = ", ".join(s.value for s in ServerState)
                raise ValueError(
                    f"bad server record: state must be one of {allowed}, got {state!r}"
                ) from None
        elif not isinstance(state, ServerState):
            raise ValueError(f"bad server record: state must be a string, got {_kind(state)}")
        for name in ("throughput", "updated_at", "expires_at"):
            # msgpack may hand back an int for a float field that happened to be whole.
            if name in kwargs and type(kwargs[name]) is int:
                kwargs[name] = float(kwargs[name])
        return cls(**kwargs)


_ALL_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ServerRecord))
_LIMIT_FIELDS = (
    "max_session_length",
    "max_sessions_per_peer",
    "max_inflight_bytes_per_peer",
    "queued_sessions",
)
_OPTIONAL_FIELDS = frozenset({"adapters", "swarm", "updated_at", "expires_at", *_LIMIT_FIELDS})
_REQUIRED_FIELDS: tuple[str, ...] = tuple(n for n in _ALL_FIELDS if n not in _OPTIONAL_FIELDS)


def _kind(value: object) -> str:
    return type(value).__name__


def _check_str(who: str, name: str, value: object, *, nonempty: bool = False) -> None:
    if not isinstance(value, str):
        raise ValueError(f"bad {who}: {name} must be a string, got {_kind(value)}")
    if nonempty and not value:
        raise ValueError(f"bad {who}: {name} must not be empty")


def _check_int(who: str, name: str, value: object) -> None:
    # bool is an int subclass; a True where a block index belongs is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"bad {who}: {name} must be an int, got {_kind(value)}")


def _check_number(who: str, name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"bad {who}: {name} must be a number, got {_kind(value)}")


def _check_str_tuple(who: str, name: str, value: object) -> None:
    if not isinstance(value, tuple):
        raise ValueError(f"bad {who}: {name} must be a list of strings, got {_kind(value)}")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"bad {who}: {name} must hold only strings, found {_kind(item)}")


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
    fields = record.to_dict()
    del fields["updated_at"], fields["expires_at"]
    return wire.ServerInfo.from_dict(fields)


def info_to_record(info: wire.ServerInfo) -> ServerRecord:
    """A received ServerInfo as a routing record; ValueError if it does not make sense."""
    return ServerRecord.from_dict(info.to_dict())
