"""A leeching node for programs that generate without serving: a libp2p host in DHT client
mode, the swarm view of one model and the client-side model pieces, in one context manager."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

import blocks
from peerd.node import compute_thread
from peerd.node.p2p import Node, open_node, parse_peer_maddr
from peerd.session.generation import Generator
from peerd.session.swarm import SwarmView
from routing.planner import NoRouteError, plan_route
from routing.records import SwarmSnapshot


@dataclass
class Leech:
    node: Node
    swarm: SwarmView
    client: blocks.ClientSide
    generator: Generator


def covered(snapshot: SwarmSnapshot) -> bool:
    """Whether some route runs every block of the model now."""
    try:
        plan_route(snapshot)
    except NoRouteError:
        return False
    return True


@asynccontextmanager
async def open_leech(
    model: str,
    initial_peers: Sequence[str],
    *,
    refresh_period: float = 5.0,
    wait_for_coverage_s: float = 60.0,
    verify_fraction: float = 0.0,
    listen: str = "/ip4/127.0.0.1/tcp/0",
) -> AsyncIterator[Leech]:
    """Join the swarm through `initial_peers` and wait until every block of `model` is served.
    `verify_fraction`: spot-check that fraction of steps on a second server
    (peerd.session.verify)."""
    checkpoint = blocks.resolve_checkpoint(model)
    # On the compute thread, where its passes will run: loading it (its LM head's tuning) on
    # another thread would give that thread an OpenMP team of its own beside the compute
    # thread's, and the process's passes would run slower while it lived (compute_thread).
    client = await compute_thread.run(blocks.load_client_side, checkpoint)
    num_blocks = int(client.config.num_hidden_layers)
    async with open_node(create_new_key_pair(), [listen], dht_server=True) as node:
        for text in initial_peers:
            with trio.fail_after(10):
                await node.connect(parse_peer_maddr(text))
        swarm = SwarmView(node, client.model, num_blocks, refresh_period=refresh_period)
        swarm.verify_fraction = verify_fraction
        if not await swarm.wait_for(covered, wait_for_coverage_s):
            plan_route(swarm.snapshot())  # raises NoRouteError naming the missing blocks
        async with trio.open_nursery() as nursery:
            nursery.start_soon(swarm.run)
            yield Leech(node, swarm, client, Generator(client, swarm))
            nursery.cancel_scope.cancel()
