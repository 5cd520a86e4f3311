"""Our Kademlia look-up of the few peers closest to a key, over py-libp2p's DHT.

py-libp2p's `find_closest_peers_network` asks peers in rounds and waits for a round's slowest
answer before it asks the next peers; every query to a peer not met before dials it first (several
round trips, docs/swarm.md), so one slow peer holds the whole look-up back, round after round.
`closest_peers` asks the same peers the same question (py-libp2p's own FIND_NODE query, so DHT
nodes see nothing new) but takes each answer as it comes: the `count` closest peers known that
were not asked yet are asked at once, whenever an answer makes them known, and the look-up is
done once the `count` closest peers known have all answered. routing.netsim simulates the same
look-up (`Network.look_up`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
from typing import NamedTuple

import trio
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID

from peerd.node.p2p import Node

log = logging.getLogger(__name__)

# Peers kept in the look-up's list of the closest known (Kademlia's k).
KNOWN = 20
# Below this many peers in our routing table, the peers we are connected to start the look-up
# too (as py-libp2p's look-up does: a daemon that just joined knows only its initial peers).
FEW_KNOWN = 5


class Found(NamedTuple):
    """What a look-up found: the `count` peers closest to the key that answered us, and the
    DHT's size as the closest of those suggest (`dht_size`)."""

    closest: list[ID]
    size: float


async def closest_peers(node: Node, key: bytes, count: int) -> Found:
    """The `count` peers closest to `key` that answered us (the caller bounds the time). A peer
    whose query failed (no connection, no answer in py-libp2p's query timeout, an empty answer)
    is dropped from the list, so it is never among them."""
    routing = node.dht.peer_routing
    own = node.peer_id
    known = routing.routing_table.find_local_closest_peers(key, KNOWN)
    if len(known) < FEW_KNOWN:
        known += node.host.get_connected_peers()
    shortlist = _closest(key, known, {own})
    asked: set[ID] = set()
    answered: set[ID] = set()
    failed: set[ID] = {own}
    send, receive = trio.open_memory_channel[tuple[ID, list[ID]]](math.inf)

    async def ask(peer: ID) -> None:
        try:
            found = await routing._query_peer_for_closest(peer, key)
        except Exception as e:  # py-libp2p's query fails in many ways; the peer is skipped
            log.debug("FIND_NODE to %s failed: %s", peer, e)
            found = []
        send.send_nowait((peer, found))

    async with trio.open_nursery() as nursery:
        while True:
            for peer in [p for p in shortlist[:count] if p not in asked]:
                asked.add(peer)
                nursery.start_soon(ask, peer)
            if all(p in answered for p in shortlist[:count]):
                break
            peer, found = await receive.receive()
            if found:
                answered.add(peer)
            else:  # gone, or knows nobody: not a holder
                failed.add(peer)
            shortlist = _closest(key, [*shortlist, *found], failed)
        nursery.cancel_scope.cancel()  # answers still on their way are from farther peers
    # The size from the closest peers that answered, all of them up to the first that did not:
    # a peer can name ids that do not exist, close to the key, to make the DHT look huge.
    sure = list(itertools.takewhile(answered.__contains__, shortlist))
    return Found(shortlist[:count], dht_size(key, sure))


def dht_size(key: bytes, closest: list[ID]) -> float:
    """How many peers the DHT holds, from the peers closest to `key` (0 if none): ids spread
    evenly over the 2**256 keys, n of them within XOR distance d of the key make about
    n * 2**256 / d in all (about 20% off for 20 peers; a swarm smaller than that is known
    whole, and is estimated at least that big)."""
    if not closest:
        return 0.0
    target = int.from_bytes(hashlib.sha256(key).digest(), "big")
    farthest = max(
        target ^ int.from_bytes(hashlib.sha256(p.to_bytes()).digest(), "big") for p in closest
    )
    return len(closest) * 2**256 / (farthest + 1)


def _closest(key: bytes, peers: list[ID], skip: set[ID]) -> list[ID]:
    unique = [p for p in dict.fromkeys(peers) if p not in skip]
    return list(sort_peer_ids_by_distance(key, unique))[:KNOWN]
