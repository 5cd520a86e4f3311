"""What a DHT node keeps under one shard key: the signed records of the servers of that shard
(of one locality cell, for a cell's key), each believed before it is kept
(routing.discovery.open_record), and what changed since a reader last asked.

Readers that come back (a server re-checking its span every couple of minutes) ask for
`changes_since` their last read: the records whose content changed (a new server, a move, a new
state or throughput; a republish with the same content is not a change) and the peers gone since.
A shard of 64 servers is ~13 KB read whole; a re-check under churn reads a tenth of that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from routing.discovery import (
    RECORDS_PER_SHARD,
    Cell,
    ForgedRecord,
    SignedRecord,
    authentic,
    buckets_of_span,
    cell_of,
    open_record,
    seconds_per_block,
    shard_of,
)
from routing.records import ServerRecord

# Peers gone from a shard are remembered this long, for readers asking what changed: a reader
# that last asked longer ago gets the whole shard again.
GONE_MEMORY_S = 1800.0


@dataclass(frozen=True)
class Changes:
    """A reply to `changes_since`: changed records, the peers gone, and whether it is the whole
    shard (the reader then drops what it kept)."""

    records: tuple[SignedRecord, ...]
    gone: tuple[str, ...]
    whole: bool

    @property
    def size(self) -> int:
        """Bytes on the wire, about: the records, 52 bytes per gone peer id, framing."""
        return sum(len(r) for r in self.records) + 52 * len(self.gone) + 16


def _content(record: ServerRecord) -> tuple[object, ...]:
    """What a reader plans with; a record that differs only in its times is no change."""
    return (record.start, record.end, record.state, record.throughput, record.relayed)


class RecordShard:
    """The records of shard `shard` of `shards` of one model, newest per peer, expired ones
    dropped, at most RECORDS_PER_SHARD (the soonest to expire go first)."""

    def __init__(
        self,
        model: str,
        num_blocks: int,
        shard: int,
        shards: int,
        swarm_name: str = "",
        cell: Cell | None = None,
    ) -> None:
        self.model, self.num_blocks, self.swarm_name = model, num_blocks, swarm_name
        self.shard, self.shards, self.cell = shard, shards, cell
        self._kept: dict[str, tuple[ServerRecord, SignedRecord]] = {}
        self._changed: dict[str, float] = {}
        self._gone: dict[str, float] = {}
        self._next_expiry = math.inf
        self._created = -math.inf

    def offer(self, signed: SignedRecord, now: float) -> ServerRecord:
        """Keep `signed` if it is believable, of this shard and newer than what we hold of its
        peer; return the record, or raise ForgedRecord/ValueError saying why not."""
        record = open_record(
            signed,
            model=self.model,
            num_blocks=self.num_blocks,
            now=now,
            swarm_name=self.swarm_name,
        )
        if shard_of(record.peer_id, self.shards) != self.shard:
            raise ForgedRecord(f"record of peer {record.peer_id} belongs to another shard")
        if self.cell is not None:
            coords = authentic(signed)[1]
            if coords is None or cell_of(coords) != self.cell:
                raise ForgedRecord(f"record of peer {record.peer_id} is not of cell {self.cell}")
        if self._created == -math.inf:
            self._created = now
        self.expire(now)
        held = self._kept.get(record.peer_id)
        if held is not None and held[0].updated_at >= record.updated_at:
            return held[0]
        if held is None or _content(held[0]) != _content(record):
            self._changed[record.peer_id] = now
        self._gone.pop(record.peer_id, None)
        self._kept[record.peer_id] = (record, signed)
        self._next_expiry = min(self._next_expiry, record.expires_at)
        if len(self._kept) > RECORDS_PER_SHARD:
            self._drop(min(self._kept, key=lambda p: self._kept[p][0].expires_at), now)
        return record

    def _drop(self, peer_id: str, now: float) -> None:
        del self._kept[peer_id]
        self._changed.pop(peer_id, None)
        self._gone[peer_id] = now

    def expire(self, now: float) -> None:
        if now < self._next_expiry:
            return
        for peer_id in [p for p, (r, _) in self._kept.items() if r.is_expired(now)]:
            self._drop(peer_id, now)
        self._next_expiry = min((r.expires_at for r, _ in self._kept.values()), default=math.inf)
        for peer_id in [p for p, at in self._gone.items() if now - at > GONE_MEMORY_S]:
            del self._gone[peer_id]

    def records(self, now: float, buckets: Iterable[int] | None = None) -> list[SignedRecord]:
        """The signed records kept, each once; only those touching `buckets` when given."""
        self.expire(now)
        if buckets is None:
            return [signed for _, signed in self._kept.values()]
        wanted = set(buckets)
        return [
            signed
            for record, signed in self._kept.values()
            if wanted.intersection(buckets_of_span(record.start, record.end))
        ]

    def fastest(self, now: float, limit: int) -> list[SignedRecord]:
        """The `limit` records kept whose servers rank first by `seconds_per_block` (their own
        word, signed): what a client reading a lane asks for, so that a lane it sized too big
        costs it no more bytes."""
        self.expire(now)
        ranked = sorted(self._kept.values(), key=lambda kept: _rank(kept[1]))
        return [signed for _, signed in ranked[:limit]]

    def changes_since(self, since: float, now: float) -> Changes:
        """What changed after `since` (the reader's last read, on our clock); the whole shard
        when we cannot tell (a first read, or one older than what we remember)."""
        self.expire(now)
        if since < max(self._created, now - GONE_MEMORY_S):
            return Changes(tuple(self.records(now)), (), True)
        changed = tuple(
            signed for p, (_, signed) in self._kept.items() if self._changed.get(p, now) > since
        )
        gone = tuple(p for p, at in self._gone.items() if at > since)
        return Changes(changed, gone, False)

    def __len__(self) -> int:
        return len(self._kept)


def _rank(signed: SignedRecord) -> float:
    record, coords = authentic(signed)
    return seconds_per_block(record, coords)
