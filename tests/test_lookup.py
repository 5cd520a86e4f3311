"""Our Kademlia look-up (peerd.node.lookup) against real in-process nodes."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio
from libp2p.kad_dht.utils import sort_peer_ids_by_distance

from peerd.node.lookup import closest_peers
from tests.test_directory import _swarm_of


async def test_a_look_up_finds_the_closest_peers_that_answer_and_skips_a_gone_one() -> None:
    async with AsyncExitStack() as stack:
        nodes = await _swarm_of(8, stack)
        reader, others = nodes[-1], nodes[:-1]
        key = b"peerd-test-key"
        truth = list(sort_peer_ids_by_distance(key, [n.peer_id for n in others]))
        with trio.fail_after(30):
            assert await closest_peers(reader, key, 3) == truth[:3]
        # The closest peer goes away: it is not a holder any more, the next one is.
        gone = next(n for n in others if n.peer_id == truth[0])
        await gone.host.close()
        with trio.fail_after(30):
            assert await closest_peers(reader, key, 3) == truth[1:4]


async def test_a_look_up_with_nobody_to_ask_finds_nobody() -> None:
    async with AsyncExitStack() as stack:
        (lonely,) = await _swarm_of(1, stack)
        with trio.fail_after(10):
            assert await closest_peers(lonely, b"any key", 3) == []
