"""Signed compact records in the DHT (routing.discovery): a record is believed only when its own
peer signed it, its span touches the bucket it came under, and its throughput is possible."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from routing.contacts import (
    choose_contacts,
    confirmed_record,
    servers_to_confirm,
)
from routing.discovery import (
    CELL_S,
    LANE_RECORDS,
    ForgedRecord,
    SignedRecord,
    authentic,
    believe,
    buckets_of_span,
    cell_of,
    cells_around,
    estimated_rtt,
    lane_tier,
    lane_tiers,
    open_record,
    seconds_per_block,
    shard_count,
    shard_key,
    shard_levels,
    shard_of,
    sign_record,
    tier_of,
)
from routing.record_store import RecordShard
from routing.records import ServerRecord, SwarmSnapshot
from tests.test_routing_fixtures import MODEL, make_record

NUM_BLOCKS = 80
NOW = 1000.0
COORDS = (0.01, -0.02, 0.004)


def key_pair(seed: int) -> KeyPair:
    return create_new_key_pair(seed.to_bytes(32, "big"))


def peer_of(keys: KeyPair) -> str:
    return ID.from_pubkey(keys.public_key).to_base58()


def own_record(keys: KeyPair, start: int, end: int, **changes: Any) -> ServerRecord:
    record = make_record(peer_of(keys), start, end, updated_at=NOW, expires_at=NOW + 60)
    return dataclasses.replace(record, **changes)


def opened(signed: SignedRecord, bucket: int | None = None) -> ServerRecord:
    return open_record(signed, model=MODEL, num_blocks=NUM_BLOCKS, now=NOW, bucket=bucket)


def test_a_record_signed_by_its_peer_opens_as_it_was_signed() -> None:
    keys = key_pair(1)
    record = own_record(keys, 8, 24, throughput=12.5)
    signed = SignedRecord.from_bytes(sign_record(record, keys.private_key, COORDS).to_bytes())
    assert opened(signed, bucket=2) == record
    assert authentic(signed) == (record, COORDS)
    assert len(signed.to_bytes()) < 300  # compact: what a shard of 64 costs to fetch


def test_a_record_for_another_peer_id_is_refused() -> None:
    mallory, alice = key_pair(1), key_pair(2)
    # Mallory cannot sign Alice's record with her own key...
    with pytest.raises(ValueError, match="cannot sign a record of peer"):
        sign_record(own_record(alice, 0, 8), mallory.private_key)
    # ...and a record she signs anyway (bypassing sign_record) names Alice but fails her key.
    mallory_signed = sign_record(own_record(mallory, 0, 8), mallory.private_key)
    alice_payload = sign_record(own_record(alice, 0, 8), alice.private_key).payload
    forged = SignedRecord(alice_payload, mallory_signed.signature)
    with pytest.raises(ForgedRecord, match="not signed by that peer's key"):
        opened(forged)
    # A changed byte of a genuine record is a forgery too (a wider span, here).
    genuine = sign_record(own_record(alice, 0, 8), alice.private_key)
    widened = sign_record(own_record(alice, 0, 16), alice.private_key).payload
    with pytest.raises(ForgedRecord, match="not signed"):
        opened(SignedRecord(widened, genuine.signature))


def test_a_span_outside_its_bucket_or_model_and_an_impossible_throughput_are_refused() -> None:
    keys = key_pair(3)
    with pytest.raises(ForgedRecord, match="outside bucket 5"):
        opened(sign_record(own_record(keys, 0, 16), keys.private_key), bucket=5)
    with pytest.raises(ForgedRecord, match="of 80 blocks"):
        opened(sign_record(own_record(keys, 70, 90), keys.private_key))
    with pytest.raises(ForgedRecord, match="no machine reaches"):
        opened(sign_record(own_record(keys, 0, 8, throughput=1e300), keys.private_key))
    with pytest.raises(ForgedRecord, match="in the future"):
        opened(sign_record(own_record(keys, 0, 8, updated_at=NOW + 3600), keys.private_key))


def test_a_shard_keeps_only_believable_records_of_its_own_shard() -> None:
    shards = 2
    shard = RecordShard(MODEL, NUM_BLOCKS, shard=0, shards=shards)
    kept = 0
    for keys in (key_pair(10 + i) for i in range(40)):
        signed = sign_record(own_record(keys, 8, 16), keys.private_key)
        if shard_of(peer_of(keys), shards) == 0:
            shard.offer(signed, NOW)
            kept += 1
        else:
            with pytest.raises(ForgedRecord, match="another shard"):
                shard.offer(signed, NOW)
    assert len(shard) == kept > 0
    liar = next(k for k in (key_pair(900 + i) for i in range(50)) if shard_of(peer_of(k), 2) == 0)
    with pytest.raises(ForgedRecord, match="no machine reaches"):
        shard.offer(sign_record(own_record(liar, 0, 8, throughput=1e9), liar.private_key), NOW)
    assert len(shard.records(NOW, buckets=[1])) == kept and not shard.records(NOW, buckets=[0])
    assert len(shard.records(NOW + 61)) == 0  # every record expired


def test_a_reader_coming_back_gets_only_what_changed() -> None:
    shard = RecordShard(MODEL, NUM_BLOCKS, shard=0, shards=1)
    a, b, c = key_pair(21), key_pair(22), key_pair(23)
    for keys in (a, b):
        shard.offer(sign_record(own_record(keys, 0, 8), keys.private_key), NOW)
    first = shard.changes_since(-math.inf, NOW)
    assert first.whole and len(first.records) == 2
    # a republishes the same content, b moves, c joins; then a's record expires.
    later = NOW + 30
    shard.offer(sign_record(own_record(a, 0, 8, updated_at=later), a.private_key), later)
    shard.offer(sign_record(own_record(b, 8, 16, updated_at=later), b.private_key), later)
    shard.offer(sign_record(own_record(c, 0, 8, updated_at=later), c.private_key), later)
    changes = shard.changes_since(NOW, later)
    assert not changes.whole
    assert {authentic(s)[0].peer_id for s in changes.records} == {peer_of(b), peer_of(c)}
    gone = shard.changes_since(later, later + 200)  # b and c (expiring at +90) and a are gone
    assert set(gone.gone) == {peer_of(a), peer_of(b), peer_of(c)} and not gone.records
    assert changes.size < first.size * 2


def test_a_client_plans_over_believed_records_and_contacts_few_servers() -> None:
    pairs = [key_pair(100 + i) for i in range(40)]
    fetched = []
    for i, keys in enumerate(pairs):
        start = (i * 8) % NUM_BLOCKS
        record = own_record(keys, start, min(NUM_BLOCKS, start + 16), throughput=5.0 + i)
        signed = sign_record(record, keys.private_key)
        fetched += [(bucket, signed) for bucket in buckets_of_span(record.start, record.end)]
    mallory = key_pair(7)
    fake = own_record(mallory, 0, NUM_BLOCKS, throughput=1e9)
    fetched.append((0, sign_record(fake, mallory.private_key)))
    believed = believe(fetched, model=MODEL, num_blocks=NUM_BLOCKS, now=NOW)
    snapshot = believed.snapshot
    assert peer_of(mallory) not in snapshot.by_peer and len(believed.refused) == 1
    assert len(snapshot.records) == len(pairs)
    contacts = choose_contacts(snapshot, now=NOW, max_contacts=12)
    assert 5 <= len(contacts) <= 12  # one route of 16-block hops is 5 servers; spares after it
    live = snapshot.by_peer[contacts[0]]
    # A server whose live answer differs from what it published is used as it answers.
    moved = dataclasses.replace(live, start=live.end - 1)
    assert confirmed_record(live, moved) == moved
    assert confirmed_record(live, dataclasses.replace(live, peer_id=peer_of(mallory))) is None


def test_shard_counts_grow_with_the_swarm_in_powers_of_two() -> None:
    counts = [shard_count(n) for n in (10, 100, 1000, 10_000)]
    assert counts[0] == 1 and counts == sorted(counts) and counts[-1] >= 128
    assert shard_levels(1) == (1, 2) and shard_levels(16) == (8, 16, 32)
    assert all(c & (c - 1) == 0 for c in counts)


def test_a_cell_shard_keeps_only_records_whose_signed_coordinates_lie_in_it() -> None:
    keys = key_pair(31)
    here = (0.01, 0.01, 0.002)  # cell (0, 0) of 30 ms cells
    shard = RecordShard(MODEL, NUM_BLOCKS, shard=0, shards=1, cell=cell_of(here))
    shard.offer(sign_record(own_record(keys, 0, 8), keys.private_key, here), NOW)
    far = (0.3, 0.01, 0.002)
    with pytest.raises(ForgedRecord, match="not of cell"):
        shard.offer(sign_record(own_record(keys, 0, 8), keys.private_key, far), NOW + 1)
    with pytest.raises(ForgedRecord, match="not of cell"):  # no coordinates: no cell
        shard.offer(sign_record(own_record(keys, 0, 8), keys.private_key), NOW + 2)
    assert len(shard) == 1
    assert estimated_rtt(here, far) == pytest.approx(0.29 + 0.004)


def test_the_2x2_cells_around_a_client_hold_everyone_within_half_a_cell() -> None:
    for where in [(0.001, 0.029, 0.0), (0.016, 0.014, 0.0), (-0.04, 0.07, 0.01)]:
        around = set(cells_around(where))
        assert len(around) == 4 and cell_of(where) in around
        for dx in (-0.49, 0.0, 0.49):
            for dy in (-0.49, 0.0, 0.49):
                near = (where[0] + dx * CELL_S, where[1] + dy * CELL_S, 0.0)
                assert cell_of(near) in around
    far = (0.016 + 1.6 * CELL_S, 0.014, 0.0)
    assert cell_of(far) not in cells_around((0.016, 0.014, 0.0))


def test_servers_rank_into_lanes_by_what_a_hop_on_them_costs_per_block() -> None:
    keys = key_pair(41)
    long_fast = own_record(keys, 0, 40, throughput=50.0)  # 1 s / 50 over 40 blocks
    short_fast = own_record(keys, 0, 4, throughput=500.0)
    assert seconds_per_block(long_fast, (0.0, 0.0, 0.002)) == pytest.approx(0.022 / 40)
    # The same speed per block: the longer span saves round trips, so it ranks first.
    height = (0.0, 0.0, 0.002)
    assert seconds_per_block(long_fast, height) < seconds_per_block(short_fast, height)
    assert seconds_per_block(own_record(keys, 0, 4, throughput=0.0), None) == math.inf
    sample = [float(i) for i in range(1, 101)]  # 100 others
    assert tier_of(0.5, sample) >= 7  # faster than all: the top lane the sample can tell
    assert tier_of(10.5, sample) == 3  # faster than 90 of 100: among the fastest 1/8
    assert tier_of(60.5, sample) == 0
    assert tier_of(1.0, []) == 1  # no sample: nothing to rank against
    # A client reads the lane of about LANE_RECORDS servers; a server publishes in every lane a
    # client with an estimate of the cell up to 4x below its own would read, up to its tier.
    assert lane_tier(LANE_RECORDS / 2) == 0 and lane_tier(LANE_RECORDS * 8) == 3
    assert lane_tiers(5, LANE_RECORDS * 8) == range(1, 6)
    assert not lane_tiers(0, LANE_RECORDS * 8)  # too slow for any lane a client reads
    for cell_size in (10, 300, 3000, 30000):
        for estimate in (cell_size / 4, cell_size, cell_size * 4):
            assert lane_tier(estimate) in lane_tiers(12, cell_size)
    cell = (3, -2)
    keys_by_tier = {shard_key(MODEL, 0, 1, cell=cell, tier=t) for t in range(4)}
    assert len(keys_by_tier) == 4 and shard_key(MODEL, 0, 1, cell=cell) in keys_by_tier


def test_a_client_asks_the_servers_its_route_wants_before_using_them() -> None:
    pairs = [key_pair(200 + i) for i in range(4)]
    a, b, c, d = (
        own_record(k, s, e, throughput=10.0)
        for k, (s, e) in zip(pairs, [(0, 40), (40, 80), (0, 80), (0, 80)], strict=True)
    )
    snapshot = SwarmSnapshot(MODEL, NUM_BLOCKS, (a, b, c, d))
    live = {a.peer_id: (0.01, a), b.peer_id: (0.01, b)}
    # c was estimated near: the route over the answers and the estimates wants it, so ask it.
    estimates = {c.peer_id: 0.001, d.peer_id: 0.2}
    assert servers_to_confirm(snapshot, live, {a.peer_id, b.peer_id}, estimates) == [c.peer_id]
    # Once c answered slower than estimated, the answers' route needs no one more (d is far).
    live[c.peer_id] = (0.3, c)
    asked = {a.peer_id, b.peer_id, c.peer_id}
    assert servers_to_confirm(snapshot, live, asked, estimates) == []
    # A server asked that did not answer is never asked again.
    assert servers_to_confirm(snapshot, {}, {p.peer_id for p in (a, b, c, d)}, estimates) == []
