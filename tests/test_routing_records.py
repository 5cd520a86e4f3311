"""ServerRecord validation and wire maps; SwarmSnapshot coverage helpers."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import wire
from routing.records import (
    SELECTION_STATES,
    ServerRecord,
    ServerState,
    SwarmSnapshot,
    contiguous_ranges,
    format_blocks,
    info_to_record,
    record_to_info,
)
from tests.test_routing_fixtures import MODEL, make_record, make_snapshot, relaxed, swarms


def test_record_round_trips_through_a_plain_map() -> None:
    record = make_record(
        "peerA",
        2,
        9,
        throughput=12.5,
        adapters=("lora-x",),
        relayed=True,
        updated_at=100.0,
        expires_at=160.0,
        state=ServerState.DRAINING,
        max_session_length=8192,
        max_sessions_per_peer=64,
        max_inflight_bytes_per_peer=1 << 28,
        queued_sessions=3,
        swarm="lab",
    )
    d = record.to_dict()
    assert d["state"] == "draining"
    assert d["swarm"] == "lab"
    assert d["addrs"] == ["/ip4/10.0.0.1/tcp/4001/p2p/peerA"]
    assert d["adapters"] == ["lora-x"]
    assert all(type(v) in (str, int, float, bool, list) for v in d.values())
    assert ServerRecord.from_dict(d) == record


def test_from_dict_fills_optional_fields_and_ignores_unknown_keys() -> None:
    d = make_record("peerA", 0, 4).to_dict()
    limits = ("max_session_length", "max_sessions_per_peer", "max_inflight_bytes_per_peer")
    for optional in ("adapters", "updated_at", "expires_at", "queued_sessions", *limits):
        del d[optional]
    d["from_a_newer_version"] = {"anything": 1}
    record = ServerRecord.from_dict(d)
    assert record.adapters == ()
    assert record.updated_at == 0.0
    assert record.expires_at == math.inf
    assert record.max_session_length == record.queued_sessions == 0


def test_from_dict_accepts_whole_numbers_for_float_fields() -> None:
    d = make_record("peerA", 0, 4).to_dict() | {"throughput": 7, "updated_at": 3}
    record = ServerRecord.from_dict(d)
    assert record.throughput == 7.0 and isinstance(record.throughput, float)
    assert isinstance(record.updated_at, float)


def _good() -> dict[str, Any]:
    return make_record("peerA", 0, 4).to_dict()


# The checks are wire.ServerInfo's (one schema, in wire/peer_protocol.py), in its words: the path
# of the bad field, then what is wrong with it.
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"start": "0"}, "start: must be an integer, got str"),
        ({"start": True}, "start: must be an integer, got bool"),
        ({"end": 0}, "end: must be > 0, got 0"),
        ({"start": 4, "end": 4}, r"block span end \(4\) must be greater than start \(4\)"),
        ({"start": -1}, "start: must be >= 0, got -1"),
        ({"throughput": -1.0}, "throughput: must be >= 0.0, got -1.0"),
        ({"throughput": math.nan}, "throughput: must be a finite number, got nan"),
        ({"throughput": math.inf}, "throughput: must be a finite number, got inf"),
        ({"throughput": "fast"}, "throughput: must be a number, got str"),
        ({"free_cache_tokens": -5}, "free_cache_tokens: must be >= 0"),
        ({"free_cache_tokens": 1.5}, "free_cache_tokens: must be an integer"),
        ({"max_session_length": -1}, "max_session_length: must be >= 0"),
        ({"queued_sessions": "3"}, "queued_sessions: must be an integer, got str"),
        ({"state": "sleeping"}, "state: must be one of joining, online, draining; got str"),
        ({"state": 1}, "state: must be one of joining, online, draining; got int"),
        ({"peer_id": ""}, "peer_id: must have at least 1 characters"),
        ({"peer_id": 7}, "peer_id: must be a string, got int"),
        ({"model": ""}, "model: must have at least 1 characters"),
        ({"version": None}, "version: required, got nothing"),
        ({"addrs": "/ip4/1.2.3.4"}, "addrs: must be a list, got str"),
        ({"addrs": ["/ip4/1.2.3.4", 5]}, r"addrs\[1\]: must be a string, got int"),
        ({"relayed": "no"}, "relayed: must be true or false, got str"),
        ({"adapters": [None]}, r"adapters\[0\]: required, got nothing"),
        ({"expires_at": math.nan}, "expires_at must not be NaN"),
        ({"updated_at": "now"}, "updated_at: must be a number, got str"),
        ({"addrs": ["/ip4/1.2.3.4"] * 33}, "addrs: must have at most 32 items"),
    ],
)
def test_from_dict_names_the_bad_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerRecord.from_dict(_good() | changes)


def test_record_and_info_convert_both_ways_without_the_expiry() -> None:
    record = make_record("peerA", 2, 9, state=ServerState.JOINING, updated_at=5.0, expires_at=9.0)
    info = record_to_info(record)
    assert type(info) is wire.ServerInfo and info.state is ServerState.JOINING
    assert "expires_at" not in info.to_dict()
    assert info_to_record(info) == dataclasses.replace(record, updated_at=0.0, expires_at=math.inf)
    assert wire.decode_message(wire.encode_message(wire.InfoResponse(record=info))).record == info


def test_from_dict_names_a_missing_field() -> None:
    d = _good()
    del d["start"], d["relayed"]
    with pytest.raises(ValueError, match=r"peer 'peerA'.*start: required field is missing"):
        ServerRecord.from_dict(d)
    del d["addrs"]
    assert ServerRecord.from_dict(d | {"start": 0}).relayed is False  # ServerInfo's defaults


@pytest.mark.parametrize("not_a_map", [None, [1, 2], "peerA", 3])
def test_from_dict_rejects_non_maps(not_a_map: Any) -> None:
    with pytest.raises(ValueError, match="expected a map"):
        ServerRecord.from_dict(not_a_map)


@relaxed
@given(
    st.dictionaries(
        st.sampled_from([*_good().keys(), "extra"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-3, 40),
            st.floats(allow_nan=True),
            st.text(max_size=5),
            st.lists(st.text(max_size=3), max_size=2),
        ),
        max_size=4,
    )
)
def test_from_dict_fails_only_with_value_error(d: dict[str, Any]) -> None:
    """Whatever a peer sends, parsing either succeeds or raises ValueError."""
    try:
        record = ServerRecord.from_dict(_good() | d)
    except ValueError:
        return
    assert ServerRecord.from_dict(record.to_dict()) == record


def test_record_derived_numbers() -> None:
    record = make_record("peerA", 4, 9, throughput=20.0)
    assert record.span == (4, 9)
    assert record.num_blocks == 5
    assert record.seconds_per_block == pytest.approx(1 / 100)
    assert record.covers(4) and record.covers(8)
    assert not record.covers(3) and not record.covers(9)
    assert make_record("peerB", 0, 1, throughput=0.0).seconds_per_block == math.inf


def test_record_expiry_is_inclusive() -> None:
    record = make_record("peerA", 0, 1, expires_at=50.0)
    assert not record.is_expired(49.9)
    assert record.is_expired(50.0)


def test_snapshot_coverage_helpers() -> None:
    snap = make_snapshot(
        8,
        make_record("a", 0, 4, throughput=10.0),
        make_record("b", 2, 6, throughput=5.0),
        make_record("c", 5, 7, throughput=1.0, state=ServerState.JOINING),
        make_record("d", 3, 8, throughput=100.0, state=ServerState.DRAINING),
    )
    assert [r.peer_id for r in snap.servers_covering(3)] == ["a", "b", "d"]
    assert [r.peer_id for r in snap.servers_covering(5, states={ServerState.ONLINE})] == ["b"]
    assert snap.block_throughputs() == (10.0, 10.0, 15.0, 15.0, 5.0, 5.0, 0.0, 0.0)
    assert snap.block_server_counts() == (1, 1, 2, 2, 1, 1, 0, 0)
    assert snap.uncovered_blocks() == (6, 7)
    assert snap.coverage() == (snap.block_throughputs(), snap.block_server_counts())
    assert snap.block_throughputs(states=SELECTION_STATES)[5:] == (6.0, 1.0, 0.0)
    assert snap.uncovered_blocks(states=SELECTION_STATES) == (7,)
    with pytest.raises(ValueError, match="block 8 is outside smollm2-135m's blocks 0-7"):
        snap.servers_covering(8)


def test_snapshot_edits_return_new_snapshots() -> None:
    snap = make_snapshot(4, make_record("a", 0, 2))
    moved = snap.with_record(make_record("a", 2, 4))
    assert snap.record("a") == make_record("a", 0, 2)
    assert moved.record("a") == make_record("a", 2, 4)
    assert len(moved.records) == 1
    assert snap.with_record(make_record("b", 0, 4)).record("b") is not None
    assert snap.without("a").records == ()
    assert snap.record("zzz") is None


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ((make_record("a", 0, 5),), "spans \\[0, 5\\) but smollm2-135m has only 4 blocks"),
        ((make_record("a", 0, 2, model="other"),), "is for model 'other'"),
        ((make_record("a", 0, 2), make_record("a", 2, 4)), "two records for peer 'a'"),
    ],
)
def test_snapshot_rejects_inconsistent_records(
    records: tuple[ServerRecord, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SwarmSnapshot(MODEL, 4, records)


def test_snapshot_needs_a_block() -> None:
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        SwarmSnapshot(MODEL, 0)


def test_from_records_keeps_what_belongs() -> None:
    old = make_record("a", 0, 2, updated_at=1.0)
    new = make_record("a", 1, 3, updated_at=2.0)
    snap = SwarmSnapshot.from_records(
        MODEL,
        4,
        [
            new,
            old,
            make_record("b", 0, 9),  # past the model's end
            make_record("c", 0, 2, model="other"),
            make_record("d", 0, 2, expires_at=10.0),
            make_record("e", 2, 4, expires_at=11.0),
        ],
        now=10.0,
    )
    assert sorted(r.peer_id for r in snap.records) == ["a", "e"]
    assert snap.record("a") == new


@relaxed
@given(swarms())
def test_block_throughputs_match_a_direct_sum(snap: SwarmSnapshot) -> None:
    for wanted in ({ServerState.ONLINE}, SELECTION_STATES):
        for block, total in enumerate(snap.block_throughputs(states=wanted)):
            holders = snap.servers_covering(block, states=wanted)
            assert total == pytest.approx(math.fsum(r.throughput for r in holders))
            assert snap.block_server_counts(states=wanted)[block] == len(holders)


def test_contiguous_ranges_and_format_blocks() -> None:
    assert contiguous_ranges([7, 1, 2, 3, 3]) == ((1, 4), (7, 8))
    assert contiguous_ranges([]) == ()
    assert format_blocks(3, 4) == "block 3"
    assert format_blocks(12, 18) == "blocks 12-17"


def test_records_are_frozen() -> None:
    record = make_record("a", 0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.start = 5  # type: ignore[misc]
