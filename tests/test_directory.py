"""Signed server records in a real py-libp2p DHT (peerd.session.directory): what a holder keeps,
what it refuses, and servers found through a Kademlia look-up of their shard's key."""

from __future__ import annotations

import dataclasses
import time
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

import wire
from peerd.devtools.localswarm import LocalSwarm, scrape_metrics
from peerd.node.p2p import Node, open_node
from peerd.node.streams import MessageStream
from peerd.session.dht_keys import block_key, model_key, models_key
from peerd.session.directory import (
    HOLDERS_FRESH_PERIODS,
    MAX_KEYS,
    PUT_BURST,
    PUT_RATE_PER_S,
    RECORDS_PROTOCOL,
    Directory,
    RecordBoard,
)
from peerd.session.swarm import BLOCK_KEYS_FROM_SERVERS, SwarmView
from routing.discovery import SignedRecord, authentic, shard_count, shard_of, sign_record
from routing.records import ServerRecord
from tests.memnet import stream_pair
from tests.test_routing_fixtures import MODEL, make_record

NUM_BLOCKS = 8


def peer_of(keys: KeyPair) -> str:
    return ID.from_pubkey(keys.public_key).to_base58()


def record_of(keys: KeyPair, start: int, end: int, **changes: Any) -> ServerRecord:
    now = time.time()
    record = make_record(peer_of(keys), start, end, updated_at=now, expires_at=now + 60)
    return dataclasses.replace(record, **changes)


def put(record: ServerRecord, signed: SignedRecord, shards: int = 1) -> wire.RecordsRequest:
    return wire.RecordsRequest(
        swarm="",
        model=MODEL,
        num_blocks=NUM_BLOCKS,
        shard=shard_of(record.peer_id, shards),
        shards=shards,
        record=signed.to_bytes(),
    )


def get(shard: int = 0, shards: int = 1) -> wire.RecordsRequest:
    return wire.RecordsRequest(
        swarm="", model=MODEL, num_blocks=NUM_BLOCKS, shard=shard, shards=shards
    )


async def ask(
    board: RecordBoard, request: wire.RecordsRequest, peer: str = "reader"
) -> wire.Message:
    """One request through the board's stream handler, as `peer` would send it."""
    client, server = stream_pair(peer, "holder")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(board.handle, server)
        messages = MessageStream(client, wire.DEFAULT_MAX_FRAME_SIZE)
        await messages.send(request)
        return await messages.receive(5)


async def test_a_holder_keeps_signed_records_and_hands_them_out() -> None:
    board = RecordBoard()
    alice, bob = create_new_key_pair(), create_new_key_pair()
    for keys, span in ((alice, (0, 4)), (bob, (4, 8))):
        record = record_of(keys, *span)
        assert await ask(board, put(record, sign_record(record, keys.private_key))) == (
            wire.RecordsReply()
        )
    reply = await ask(board, get())
    assert isinstance(reply, wire.RecordsReply)
    held = {authentic(SignedRecord.from_bytes(r))[0].peer_id for r in reply.records}
    assert held == {peer_of(alice), peer_of(bob)}
    assert board.kept == 2 and board.refused == 0


async def test_forged_records_and_bad_requests_are_refused_with_the_reason() -> None:
    board = RecordBoard()
    alice, mallory = create_new_key_pair(), create_new_key_pair()
    honest = record_of(alice, 0, 4)
    # Mallory signs a record that names Alice: the signature is not Alice's.
    forged = SignedRecord(
        sign_record(honest, alice.private_key).payload,
        sign_record(record_of(mallory, 0, 4), mallory.private_key).signature,
    )
    too_fast = record_of(mallory, 0, 4, throughput=1e9)
    outside = record_of(mallory, 0, NUM_BLOCKS + 4)
    cases = [
        (put(honest, forged), "not signed by that peer's key"),
        (put(too_fast, sign_record(too_fast, mallory.private_key)), "no machine reaches"),
        (put(outside, sign_record(outside, mallory.private_key)), "spans"),
        (dataclasses.replace(put(honest, forged), record=b"\x93junk"), "signed record"),
        (get(shard=3, shards=2), "does not exist"),
    ]
    for request, says in cases:
        reply = await ask(board, request)
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BAD_REQUEST, reply
        assert says in reply.message, reply.message
    # A record stored under a shard it does not belong to is refused too.
    record = record_of(alice, 0, 4)
    wrong = put(record, sign_record(record, alice.private_key), 8)
    wrong = dataclasses.replace(wrong, shard=(wrong.shard + 1) % 8)
    reply = await ask(board, wrong)
    assert isinstance(reply, wire.Error) and "another shard" in reply.message
    assert await ask(board, get()) == wire.RecordsReply()  # nothing was kept


async def test_a_peer_flooding_record_puts_is_held_to_its_rate_and_nobody_else_is() -> None:
    """PUT_BURST puts at once, then PUT_RATE_PER_S: further puts are refused (busy, saying
    when to come back) before their record is checked; another peer's puts and every read still
    go through, and the flooder may put again once its bucket refills."""
    now = [time.time()]
    board = RecordBoard(clock=lambda: now[0])
    keys = create_new_key_pair()
    record = record_of(keys, 0, 4)
    request = put(record, sign_record(record, keys.private_key))
    replies = [await ask(board, request, "flooder") for _ in range(PUT_BURST + 3)]
    assert replies[:PUT_BURST] == [wire.RecordsReply()] * PUT_BURST
    for reply in replies[PUT_BURST:]:
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BUSY, reply
        assert "too many record puts from flooder" in reply.message, reply.message
    assert board.kept == PUT_BURST and board.throttled == 3
    other = create_new_key_pair()
    theirs = record_of(other, 4, 8)
    assert await ask(board, put(theirs, sign_record(theirs, other.private_key)), "honest") == (
        wire.RecordsReply()
    )
    reply = await ask(board, get(), "flooder")
    assert isinstance(reply, wire.RecordsReply) and len(reply.records) == 2
    now[0] += 1 / PUT_RATE_PER_S  # one token back
    assert await ask(board, request, "flooder") == wire.RecordsReply()
    assert isinstance(await ask(board, request, "flooder"), wire.Error)
    assert board.throttled == 4


def test_a_holder_keeps_at_most_max_keys_shard_keys() -> None:
    board = RecordBoard()
    keys = create_new_key_pair()
    record = record_of(keys, 0, 4)
    signed = sign_record(record, keys.private_key)
    for shards in range(1, MAX_KEYS + 6):  # every shard count is another key
        board.put(put(record, signed, shards))
    assert len(board.shards) == MAX_KEYS


async def _swarm_of(count: int, stack: AsyncExitStack) -> list[Node]:
    """`count` nodes on loopback, each connected to the first (a DHT of `count`), each holding
    a record board."""
    nodes = []
    for _ in range(count):
        node = await stack.enter_async_context(
            open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], mdns=False)
        )
        nodes.append(node)
    for node in nodes[1:]:
        first = nodes[0]
        await node.connect(PeerInfo(first.peer_id, first.host.get_addrs()))
    for node in nodes:
        board = RecordBoard()
        node.host.set_stream_handler(RECORDS_PROTOCOL, board.handle)
        node.board = board  # type: ignore[attr-defined]
    for node in nodes:  # a Kademlia bootstrap: each looks itself up, as a daemon's DHT does
        await node.dht.peer_routing.find_closest_peers_network(node.peer_id.to_bytes())
    return nodes


def _directory(node: Node) -> Directory:
    directory = Directory(node, MODEL, NUM_BLOCKS)
    directory.board = node.board  # type: ignore[attr-defined]
    return directory


async def test_servers_are_found_through_their_shard_keys_holders() -> None:
    async with AsyncExitStack() as stack:
        nodes = await _swarm_of(5, stack)
        spans = [(0, 3), (3, 6), (6, 8), (0, 8)]
        with trio.fail_after(60):
            for node, span in zip(nodes[1:], spans, strict=True):
                record = make_record(
                    node.peer_id.to_string(),
                    *span,
                    updated_at=time.time(),
                    expires_at=time.time() + 60,
                    addrs=tuple(node.maddrs()),
                )
                assert await _directory(node).publish(record, estimated_servers=4) >= 2
            reader = _directory(nodes[0])
            believed = await reader.read(estimated_servers=4)
        found = {r.peer_id: r.span for r in believed.snapshot.records}
        assert found == {n.peer_id.to_string(): s for n, s in zip(nodes[1:], spans, strict=True)}
        assert not believed.refused
        # Every record names addresses the reader can dial, and the look-ups were counted.
        assert all(r.addrs for r in believed.snapshot.records)
        assert reader.stats.lookups >= 1 and reader.stats.record_bytes > 0
        assert reader.stats.lookup_messages >= 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_daemons_find_each_other_through_signed_records() -> None:
    """Three servers publish their records; a client daemon that joins later reads them from
    the DHT and routes, and says what that cost (peerd_discovery_* metrics)."""
    swarm = LocalSwarm()
    try:
        servers = [
            swarm.start(name, span, "--metrics-port", "0")
            for name, span in (("a", "0:10"), ("b", "10:20"), ("c", "20:30"))
        ]
        ports = [s.metrics_port() for s in servers]
        deadline = time.monotonic() + 120
        while sum(scrape_metrics(p).get("peerd_records_held", 0) for p in ports) < 3:
            assert time.monotonic() < deadline, "the servers' records never reached a holder"
            time.sleep(1)
        client = swarm.start("y", "none", "--metrics-port", "0")
        port = client.metrics_port()
        while "peerd_discovery_first_route_seconds" not in (seen := scrape_metrics(port)):
            assert time.monotonic() < deadline, f"the client found no route: {seen}"
            time.sleep(1)
        assert seen["peerd_discovery_first_route_lookups"] >= 1
        assert seen["peerd_discovery_first_route_record_bytes"] > 0
        assert seen["peerd_discovery_first_route_contacts"] >= 3
        assert sum(scrape_metrics(p)["peerd_records_refused_total"] for p in ports) == 0
        # Servers publishing every 2 s refresh period are never held to the put rate.
        assert sum(scrape_metrics(p)["peerd_record_puts_throttled_total"] for p in ports) == 0
    finally:
        swarm.stop()


async def test_a_look_up_s_holders_serve_until_they_age_or_one_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Holders found for a key are used again (a publish, then a read of the same key) for
    HOLDERS_FRESH_PERIODS refresh periods; a failed request to one of them, or their age, sends
    the next use to the DHT again; a look-up that found nobody is not kept."""
    me, other = (ID.from_base58(peer_of(create_new_key_pair())) for _ in range(2))
    node: Any = type("N", (), {"peer_id": me, "dht": type("D", (), {"mode": DHTMode.SERVER})})
    directory = Directory(node, MODEL, 30, refresh_period=2.0)
    found = [[other, me]]
    lookups: list[bytes] = []

    async def look_up(key: bytes, count: int) -> list[ID]:
        lookups.append(key)
        return found[0]

    directory._look_up = look_up  # type: ignore[method-assign]
    key = b"k" * 32
    assert await directory.holders(key, 3) == [other, me]
    assert await directory.holders(key, 3) == [other, me] and len(lookups) == 1
    directory._failed(other)
    await directory.holders(key, 3)
    assert len(lookups) == 2
    await trio.sleep(HOLDERS_FRESH_PERIODS * 2.0 + 0.1)
    await directory.holders(key, 3)
    assert len(lookups) == 3
    found[0] = [me]  # nobody else answered: ask the DHT again next time
    await trio.sleep(HOLDERS_FRESH_PERIODS * 2.0 + 0.1)
    await directory.holders(key, 3)
    await directory.holders(key, 3)
    assert len(lookups) == 5


async def test_a_daemon_new_to_a_big_swarm_reads_at_the_size_its_look_up_found() -> None:
    """A daemon knowing no servers shards by 1; when that read finds nobody and its look-ups
    say the DHT holds thousands, it reads again at their shard count, and publishes at it."""
    me = ID.from_base58(peer_of(create_new_key_pair()))
    node: Any = type("N", (), {"peer_id": me, "dht": type("D", (), {"mode": DHTMode.SERVER})})
    directory = Directory(node, MODEL, 30)
    keys = create_new_key_pair()
    signed = sign_record(record_of(keys, 0, 30), keys.private_key)
    read: list[int] = []

    async def read_shard(shard: int, shards: int) -> list[SignedRecord]:
        read.append(shards)
        directory.sizes.append(10_000.0)  # what the look-up of that key found
        return [signed] if shards == shard_count(10_000) else []

    directory.read_shard = read_shard  # type: ignore[method-assign]
    believed = await directory.read(estimated_servers=0)
    assert read == [1, shard_count(10_000)]
    assert [r.peer_id for r in believed.snapshot.records] == [peer_of(keys)]
    # Two look-ups are not yet enough to shard by (one is often several times off); three are.
    assert directory.estimate(3) == 3.0
    directory.sizes.append(9_000.0)
    assert directory.estimate(3) == 10_000.0 and directory.estimate(20_000) == 20_000.0


async def test_block_keys_are_provided_only_when_the_directory_did_not_keep_our_record() -> None:
    # A server whose view holds BLOCK_KEYS_FROM_SERVERS servers provides its blocks' keys only
    # when no holder kept its record: readers find it in the directory, and the block keys'
    # provides were most of an idle server's work.
    async with AsyncExitStack() as stack:
        nodes = await _swarm_of(3, stack)
        server = nodes[1]
        record = record_of(create_new_key_pair(), 2, 5)
        record = dataclasses.replace(record, peer_id=server.peer_id.to_string())
        view = SwarmView(server, MODEL, NUM_BLOCKS, refresh_period=60, own_record=lambda: record)
        view.records = {f"p{i}": record for i in range(BLOCK_KEYS_FROM_SERVERS)}
        blocks = {bytes.fromhex(block_key(MODEL, b)) for b in range(2, 5)}
        wanted = {bytes.fromhex(model_key(MODEL)), bytes.fromhex(models_key())}

        def provided() -> set[bytes]:
            return {key for n in nodes for key in n.dht.provider_store.providers}

        with trio.fail_after(60):
            await view.announce(range(2, 5))
            assert wanted <= provided() and not blocks & provided()
            for node in nodes:  # nobody holds records any more: the publish keeps nothing
                node.host.remove_stream_handler(RECORDS_PROTOCOL)
            view.directory._holders.clear()
            await view.announce(range(2, 5))
            assert blocks <= provided()
