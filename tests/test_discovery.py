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

from routing.discovery import (
    ForgedRecord,
    SignedRecord,
    authentic,
    believe,
    buckets_of_span,
    cell_of,
    choose_contacts,
    confirmed_record,
    estimated_rtt,
    open_record,
    shard_count,
    shard_levels,
    shard_of,
    sign_record,
)
from routing.record_store import RecordShard
from routing.records import ServerRecord
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
    here = (0.01, 0.01, 0.002)  # cell (0, 0) of 50 ms cells
    shard = RecordShard(MODEL, NUM_BLOCKS, shard=0, shards=1, cell=cell_of(here))
    shard.offer(sign_record(own_record(keys, 0, 8), keys.private_key, here), NOW)
    far = (0.3, 0.01, 0.002)
    with pytest.raises(ForgedRecord, match="not of cell"):
        shard.offer(sign_record(own_record(keys, 0, 8), keys.private_key, far), NOW + 1)
    with pytest.raises(ForgedRecord, match="not of cell"):  # no coordinates: no cell
        shard.offer(sign_record(own_record(keys, 0, 8), keys.private_key), NOW + 2)
    assert len(shard) == 1
    assert estimated_rtt(here, far) == pytest.approx(0.29 + 0.004)
