"""Our Kademlia look-up (peerd.node.lookup) against real in-process nodes."""

from __future__ import annotations

import random
import statistics
from contextlib import AsyncExitStack

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID

from peerd.node.lookup import closest_peers, dht_size
from tests.test_directory import _swarm_of


async def test_a_look_up_finds_the_closest_peers_that_answer_and_skips_a_gone_one() -> None:
    async with AsyncExitStack() as stack:
        nodes = await _swarm_of(8, stack)
        reader, others = nodes[-1], nodes[:-1]
        key = b"peerd-test-key"
        truth = list(sort_peer_ids_by_distance(key, [n.peer_id for n in others]))
        with trio.fail_after(30):
            found = await closest_peers(reader, key, 3)
        assert found.closest == truth[:3] and found.size >= 3
        # The closest peer goes away: it is not a holder any more, the next one is.
        gone = next(n for n in others if n.peer_id == truth[0])
        await gone.host.close()
        with trio.fail_after(30):
            assert (await closest_peers(reader, key, 3)).closest == truth[1:4]


async def test_a_look_up_with_nobody_to_ask_finds_nobody() -> None:
    async with AsyncExitStack() as stack:
        (lonely,) = await _swarm_of(1, stack)
        with trio.fail_after(10):
            assert await closest_peers(lonely, b"any key", 3) == ([], 0.0)


def test_the_closest_peers_to_a_key_tell_the_dht_s_size() -> None:
    rng = random.Random(7)
    peers = [ID.from_pubkey(create_new_key_pair(rng.randbytes(32)).public_key) for _ in range(2000)]
    estimates = []
    for i in range(30):
        key = f"key-{i}".encode()
        estimates.append(dht_size(key, sort_peer_ids_by_distance(key, peers)[:20]))
    # About 20% off each; the median of a few is well within the 2x that shard levels absorb.
    assert 1400 <= statistics.median(estimates) <= 2800
    # A DHT smaller than the peers asked for is known whole: at least its own size.
    few = peers[:5]
    assert dht_size(b"k", sort_peer_ids_by_distance(b"k", few)) >= 5
    assert dht_size(b"k", []) == 0.0


async def test_ids_a_peer_makes_up_near_the_key_do_not_inflate_the_size() -> None:
    """A peer names ids that do not exist among the real peers near the key (farther than the
    closest few, so the look-up never needs to ask them): believed, they would make the DHT
    look bigger than it is."""
    async with AsyncExitStack() as stack:
        nodes = await _swarm_of(8, stack)
        reader, key = nodes[-1], b"peerd-test-key"
        truth = sort_peer_ids_by_distance(key, [n.peer_id for n in nodes[:-1]])
        rng = random.Random(3)
        made_up = [
            ID.from_pubkey(create_new_key_pair(rng.randbytes(32)).public_key) for _ in range(400)
        ]
        ranked = sort_peer_ids_by_distance(key, [*made_up, truth[3], truth[-1]])
        between = ranked[ranked.index(truth[3]) + 1 : ranked.index(truth[-1])][:20]
        assert len(between) >= 10
        routing = reader.dht.peer_routing
        query = routing._query_peer_for_closest

        async def lying(peer: ID, target: bytes) -> list[ID]:
            found = await query(peer, target)  # a made-up id has no address: nobody answers
            return [*between, *found] if peer not in between else found

        routing._query_peer_for_closest = lying  # type: ignore[method-assign]
        with trio.fail_after(30):
            found = await closest_peers(reader, key, 3)
        assert found.closest == truth[:3]
        # The size comes from the closest real peers alone, however many of them answered.
        assert found.size in {dht_size(key, truth[:n]) for n in range(3, len(truth) + 1)}
