"""Discovery that scales: signed compact server records, kept in the DHT in shards, and which
servers a client contacts before its first token.

A server publishes what a client needs to plan (its span, throughput, free cache, state, relayed,
addresses, network coordinates) as a compact record it signs with its libp2p key
(`sign_record`). Servers are split into `shard_count` shards by peer id, about SERVERS_PER_SHARD
each, so that one DHT key (`shard_key`) never holds the whole swarm and the DHT nodes closest to
it are no hot spot; a server stores its record under its shard's key at three shard counts
(`shard_levels`), so that peers whose estimates of the swarm's size differ still meet. The DHT
nodes closest to a key keep its records (routing.record_store), block bucket by block bucket
(BUCKET_BLOCKS blocks each), so that a client needing some blocks fetches only their records.

`open_record` is where a record is believed or not, on the storing node and again on the client:
its signature must verify with the key its peer id names (an Ed25519 peer id holds its public key,
so nobody can publish a record for another peer id), its span must lie inside the model (and
touch the bucket it was fetched for), and its throughput must be one a machine can reach
(routing.speeds.MAX_BLOCK_STEPS_PER_S). Whatever else a record claims is the server's word: the
client still plans with credible throughputs (routing.speeds) and confirms the few servers it
contacts with a live `info` call (routing.contacts.confirmed_record) before a route uses them.

Servers near a client are found through locality cells of network coordinates (`cell_of`), and
the fast ones among them through lanes (`lane_tiers`): a server also stores its record under its
cell's keys of the tiers it ranks in by `seconds_per_block`, so that a client reads about
LANE_RECORDS of the fastest servers of each cell around it (`cells_around`, `lane_tier`) in one
look-up each, whatever the cell's size.

A client reads a shard and those lanes (a few KB each), plans over those records with RTTs
estimated from coordinates, and contacts only the servers routing.contacts chooses, instead of
every server the DHT names.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgpack
from libp2p.crypto.keys import PrivateKey
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID

from routing.records import ServerRecord, SwarmSnapshot
from routing.speeds import MAX_BLOCK_STEPS_PER_S
from wire import ServerState

# Blocks per bucket: a client that needs only some blocks asks a shard for the records of their
# buckets; an 80-block model has 10.
BUCKET_BLOCKS = 8
# Servers per shard the shard count aims at: one shard of ~64 records is ~13 KB on the wire, and
# a client's first route reads a few. A DHT node keeps at most RECORDS_PER_SHARD under one key
# (a swarm grows between estimates).
SERVERS_PER_SHARD = 64
RECORDS_PER_SHARD = 256
MAX_SHARDS = 1 << 12
# A signed record bigger than this is refused unread (a record with one address is ~200 bytes).
MAX_SIGNED_RECORD_BYTES = 2048
# Signatures cover this prefix and the payload, so a record signature cannot be replayed as a
# signature of anything else the same key signs.
SIGNATURE_DOMAIN = b"peerd/server-record/1\x00"
# A record claiming to be made this far in our future is refused (clocks differ, but not by
# hours); one that claims to live longer than MAX_RECORD_LIFETIME_S is kept only that long.
MAX_CLOCK_SKEW_S = 300.0
MAX_RECORD_LIFETIME_S = 3600.0
# Multihash code of an identity hash: an Ed25519 peer id carries its public key inline.
_IDENTITY_MULTIHASH = 0x00
_STATES = (ServerState.JOINING, ServerState.ONLINE, ServerState.DRAINING)


class ForgedRecord(ValueError):
    """A record that must not be believed: bad signature, another peer's id, a span outside the
    bucket it came under, an impossible throughput. The message says which."""


def bucket_of(block: int) -> int:
    return block // BUCKET_BLOCKS


def buckets_of_span(start: int, end: int) -> range:
    """The buckets blocks [start, end) touch."""
    if not 0 <= start < end:
        raise ValueError(f"a span needs 0 <= start < end, got [{start}, {end})")
    return range(bucket_of(start), bucket_of(end - 1) + 1)


def shard_count(estimated_servers: float) -> int:
    """Shards for a swarm of about `estimated_servers` servers (a power of two, so that peers
    whose estimates differ by less than 2x mostly agree): about SERVERS_PER_SHARD each."""
    wanted = max(1.0, estimated_servers / SERVERS_PER_SHARD)
    return min(MAX_SHARDS, 1 << round(math.log2(wanted)))


def shard_levels(shards: int) -> tuple[int, ...]:
    """The shard counts a server publishes under when its own estimate gives `shards`: half,
    the same and twice as many, so that a client whose estimate of the swarm's size is off by
    up to 2x from the server's still finds it (estimates from a Kademlia look-up are ~20% off,
    and two peers on either side of a power of two round differently)."""
    return tuple(n for n in (shards // 2, shards, shards * 2) if 1 <= n <= MAX_SHARDS)


def shard_of(peer_id: str, shards: int) -> int:
    digest = hashlib.sha256(peer_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % shards


Cell = tuple[int, int]
# Side of a locality cell in network coordinates. A client reads the 2x2 cells around it
# (`cells_around`), so every server within CELL_S / 2 of it in each coordinate is in one of them
# (one cell alone misses the half of a client's neighbourhood across a cell's edge). 30 ms: a
# dense region (a metro, a continent's backbone) and a bit of the next.
CELL_S = 0.03
# A cell's servers are kept in lanes by tier: tier t holds those among the fastest 1/2**t of the
# swarm by `seconds_per_block` (what a hop on them costs per block before the distance to them),
# so that a client can read the fastest few servers near it in one look-up per cell, however
# big the cell is. A client reads the tier of each cell that holds about LANE_RECORDS servers.
LANE_RECORDS = 64
MAX_TIER = 12


def cell_of(coords: Coords) -> Cell:
    return (math.floor(coords[0] / CELL_S), math.floor(coords[1] / CELL_S))


def cells_around(coords: Coords) -> list[Cell]:
    """The 2x2 cells that together hold the square of side CELL_S centred on `coords`."""
    x, y = (math.floor(v / CELL_S - 0.5) for v in coords[:2])
    return [(x + i, y + j) for i in (0, 1) for j in (0, 1)]


def seconds_per_block(record: ServerRecord, coords: Coords | None) -> float:
    """What a hop on `record`'s server costs per block of its span before the distance to it:
    its access delay (the height of its coordinates) and one step over its span (routing.planner
    charges the same), over the span's length. A long span on a fast, well-connected machine
    ranks first."""
    if record.throughput <= 0:
        return math.inf
    height = coords[2] if coords is not None else 0.0
    return (height + 1.0 / record.throughput) / record.num_blocks


def tier_of(mine: float, sample: Iterable[float]) -> int:
    """The tier of a server of `mine` seconds per block, ranked within `sample` (other servers'
    `seconds_per_block`): the highest t for which it is among the fastest 1/2**t."""
    values = list(sample)
    share = (sum(1 for v in values if v < mine) + 0.5) / (len(values) + 1)
    return min(MAX_TIER, math.floor(-math.log2(share)))


def lane_tier(cell_servers: float, records: int = LANE_RECORDS) -> int:
    """The tier whose lane holds about `records` of a cell of about `cell_servers` servers."""
    return min(MAX_TIER, max(0, math.ceil(math.log2(max(1.0, cell_servers / records)))))


def lane_tiers(tier: int, cell_servers: float) -> range:
    """The lanes a server of `tier` in a cell of about `cell_servers` servers publishes in: every
    tier up to its own that a client might read, down to one holding 4 * LANE_RECORDS servers (a
    client whose estimate of the cell is up to 4x below ours still finds us; fuller lanes,
    which no client reads, cost their holders and us for nothing)."""
    return range(lane_tier(cell_servers, 4 * LANE_RECORDS), tier + 1)


def shard_key(
    model: str,
    shard: int,
    shards: int,
    swarm_name: str = "",
    cell: Cell | None = None,
    tier: int = 0,
) -> bytes:
    """The DHT key (sha-256 of its name) of shard `shard` of `shards` of `model`'s servers, or
    of the servers of one locality `cell` (of its lane `tier`, when > 0); the count is in the
    name: shard 3 of 8 and shard 3 of 16 hold different servers."""
    prefix = f"peerd/{swarm_name}/" if swarm_name else "peerd/"
    where = "" if cell is None else f"cell/{cell[0]},{cell[1]}/"
    where += f"tier-{tier}/" if cell is not None and tier > 0 else ""
    return hashlib.sha256(f"{prefix}{model}/servers/{where}{shard}-of-{shards}".encode()).digest()


@dataclass(frozen=True)
class SignedRecord:
    """A compact record (`payload`) and its author's signature over SIGNATURE_DOMAIN + payload."""

    payload: bytes
    signature: bytes

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.payload, self.signature], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedRecord:
        if len(data) > MAX_SIGNED_RECORD_BYTES:
            raise ValueError(f"signed record of {len(data)} bytes > {MAX_SIGNED_RECORD_BYTES}")
        try:
            fields = msgpack.unpackb(data, raw=False)
        except Exception as error:
            raise ValueError(f"signed record is not msgpack: {error}") from None
        if (
            not isinstance(fields, list)
            or len(fields) != 2
            or not all(isinstance(f, bytes) for f in fields)
        ):
            raise ValueError("signed record must be [payload bytes, signature bytes]")
        return cls(fields[0], fields[1])

    def __len__(self) -> int:
        return len(self.payload) + len(self.signature) + 6


Coords = tuple[float, float, float]
# Network coordinates (Vivaldi-style: x, y and a height for the access link, all in seconds): a
# record may carry its server's, so that a client ranks servers by estimated RTT before it has
# pinged any. Values outside this bound are refused.
MAX_COORD_S = 10.0


def estimated_rtt(a: Coords, b: Coords) -> float:
    """Round trip between two peers estimated from their coordinates, in seconds."""
    return math.hypot(a[0] - b[0], a[1] - b[1]) + a[2] + b[2]


def _check_coords(raw: object) -> Coords | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != 3:
        raise ValueError("record payload's coords must be [x, y, height]")
    if not all(isinstance(v, float) and math.isfinite(v) and abs(v) <= MAX_COORD_S for v in raw):
        raise ValueError(f"record payload's coords must be finite seconds within {MAX_COORD_S:g}")
    if raw[2] < 0:
        raise ValueError("record payload's coords height must be >= 0")
    return (raw[0], raw[1], raw[2])


def encode_payload(record: ServerRecord, coords: Coords | None = None) -> bytes:
    """The fields a client plans with, as a msgpack list (field names cost more than values)."""
    return msgpack.packb(
        [
            1,
            record.peer_id,
            record.model,
            record.swarm,
            record.start,
            record.end,
            record.throughput,
            record.free_cache_tokens,
            _STATES.index(record.state),
            record.relayed,
            record.updated_at,
            record.expires_at if math.isfinite(record.expires_at) else 0.0,
            list(record.addrs),
            record.version,
            record.max_session_length,
            None if coords is None else [float(v) for v in coords],
        ],
        use_bin_type=True,
    )


def decode_payload(payload: bytes) -> tuple[ServerRecord, Coords | None]:
    """A compact record back as a ServerRecord and coordinates; ValueError naming what is
    wrong."""
    try:
        f = msgpack.unpackb(payload, raw=False)
    except Exception as error:
        raise ValueError(f"record payload is not msgpack: {error}") from None
    if not isinstance(f, list) or len(f) < 16 or f[0] != 1:
        raise ValueError("record payload is not a version-1 compact record")
    if not isinstance(f[8], int) or not 0 <= f[8] < len(_STATES):
        raise ValueError(f"record payload has an unknown state {f[8]!r}")
    if not isinstance(f[12], list):
        raise ValueError("record payload's addrs must be a list")
    record = ServerRecord.from_dict(
        {
            "peer_id": f[1],
            "model": f[2],
            "swarm": f[3],
            "start": f[4],
            "end": f[5],
            "throughput": f[6],
            "free_cache_tokens": f[7],
            "state": _STATES[f[8]].value,
            "relayed": f[9],
            "updated_at": f[10],
            "expires_at": f[11] or math.inf,
            "addrs": f[12],
            "version": f[13],
            "max_session_length": f[14],
        }
    )
    return record, _check_coords(f[15])


def sign_record(
    record: ServerRecord, private_key: PrivateKey, coords: Coords | None = None
) -> SignedRecord:
    """Sign our own record (and our coordinates); ValueError if `record` names another peer
    than the key's."""
    own = ID.from_pubkey(private_key.get_public_key()).to_base58()
    if record.peer_id != own:
        raise ValueError(f"a key of peer {own} cannot sign a record of peer {record.peer_id}")
    payload = encode_payload(record, coords)
    return SignedRecord(payload, private_key.sign(SIGNATURE_DOMAIN + payload))


@functools.lru_cache(maxsize=1 << 16)
def authentic(signed: SignedRecord) -> tuple[ServerRecord, Coords | None]:
    """The record and coordinates `signed` holds if its own peer signed it (ForgedRecord if
    not, ValueError if malformed). Cached: a record fetched again is not verified again."""
    record, coords = decode_payload(signed.payload)
    _verify_signature(signed, record.peer_id)
    return record, coords


def _verify_signature(signed: SignedRecord, peer_id: str) -> None:
    try:
        raw = ID.from_base58(peer_id).to_bytes()
    except Exception:
        raise ForgedRecord(f"record's peer id {peer_id!r} is not a peer id") from None
    # An identity multihash: code 0x00, a one-byte length, then the protobuf public key.
    if len(raw) < 3 or raw[0] != _IDENTITY_MULTIHASH or raw[1] != len(raw) - 2:
        raise ForgedRecord(
            f"peer {peer_id}'s id does not carry its public key (only Ed25519 peers publish "
            "records in the DHT; others are found through provider records and `info`)"
        )
    try:
        key = deserialize_public_key(raw[2:])
        valid = key.verify(SIGNATURE_DOMAIN + signed.payload, signed.signature)
    except Exception:
        valid = False
    if not valid:
        raise ForgedRecord(f"record of peer {peer_id} is not signed by that peer's key")


def open_record(
    signed: SignedRecord,
    *,
    model: str,
    num_blocks: int,
    now: float,
    bucket: int | None = None,
    swarm_name: str = "",
) -> ServerRecord:
    """The record `signed` holds, if it may be believed; ForgedRecord (or ValueError for a
    malformed one) saying why not. `bucket`: the bucket whose key it was stored under."""
    record = authentic(signed)[0]
    who = f"record of peer {record.peer_id}"
    if record.model != model or record.swarm != swarm_name:
        raise ForgedRecord(f"{who} is for {record.swarm}/{record.model}, not {swarm_name}/{model}")
    if record.end > num_blocks:
        raise ForgedRecord(f"{who} spans [{record.start}, {record.end}) of {num_blocks} blocks")
    if bucket is not None and bucket not in buckets_of_span(record.start, record.end):
        raise ForgedRecord(
            f"{who} spans [{record.start}, {record.end}), outside bucket {bucket} it came under"
        )
    if record.throughput * record.num_blocks > MAX_BLOCK_STEPS_PER_S:
        raise ForgedRecord(
            f"{who} claims {record.throughput:g} tokens/s over {record.num_blocks} blocks, "
            f"more than {MAX_BLOCK_STEPS_PER_S:g} block steps/s no machine reaches"
        )
    if record.updated_at > now + MAX_CLOCK_SKEW_S:
        raise ForgedRecord(f"{who} is dated {record.updated_at - now:.0f} s in the future")
    lifetime = min(record.expires_at, record.updated_at + MAX_RECORD_LIFETIME_S)
    if lifetime != record.expires_at:
        record = _with_expiry(record, lifetime)
    if record.is_expired(now):
        raise ValueError(f"{who} expired {now - record.expires_at:.0f} s ago")
    return record


def _with_expiry(record: ServerRecord, expires_at: float) -> ServerRecord:
    return dataclasses.replace(record, expires_at=expires_at)


@dataclass(frozen=True)
class Believed:
    """What a client makes of the records it fetched: the snapshot it plans over, the
    coordinates servers published, and why each refused record was refused."""

    snapshot: SwarmSnapshot
    coords: Mapping[str, Coords]
    refused: tuple[str, ...]


def believe(
    fetched: Iterable[tuple[int | None, SignedRecord]],
    *,
    model: str,
    num_blocks: int,
    now: float,
    swarm_name: str = "",
) -> Believed:
    """A client's view from (bucket, signed record) pairs fetched from the DHT (bucket None: a
    key not tied to a bucket): a forged record is never used."""
    records: list[ServerRecord] = []
    coords: dict[str, Coords] = {}
    refused: list[str] = []
    for bucket, signed in fetched:
        try:
            record = open_record(
                signed,
                model=model,
                num_blocks=num_blocks,
                now=now,
                bucket=bucket,
                swarm_name=swarm_name,
            )
        except ValueError as error:
            refused.append(str(error))
            continue
        records.append(record)
        if (where := authentic(signed)[1]) is not None:
            coords[record.peer_id] = where
    snapshot = SwarmSnapshot.from_records(model, num_blocks, records, now=now)
    return Believed(snapshot, coords, tuple(refused))
