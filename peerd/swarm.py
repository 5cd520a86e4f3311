"""What this daemon knows of the swarm: announcing its own blocks in the DHT, finding who serves
the others, and confirming each candidate with a live `info` call before routing through it.

The DHT only says who *might* serve a block (py-libp2p keeps provider records long after a peer
dies); a server is in our view only while it answers `info`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterable

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

import wire
from peerd.p2p import INFO_PROTOCOL, Node
from peerd.server import info_to_record
from peerd.streams import MessageStream, PeerGone
from routing.bans import BanList
from routing.planner import Route, plan_route
from routing.records import ServerRecord, SwarmSnapshot
from routing.rtt import RttTracker

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 3.0
# sha2-256 multihash prefix: remote DHT nodes accept multihash keys of any length we need.
_MULTIHASH_SHA256 = b"\x12\x20"


def block_key(model: str, block: int) -> str:
    """The DHT provider key of one block of one model (hex of a sha2-256 multihash)."""
    digest = hashlib.sha256(f"peerd/{model}/block/{block}".encode()).digest()
    return (_MULTIHASH_SHA256 + digest).hex()


class SwarmView:
    """This daemon's live picture of the servers of one model."""

    def __init__(
        self,
        node: Node,
        model: str,
        num_blocks: int,
        *,
        refresh_period: float,
        own_record: Callable[[], ServerRecord | None] = lambda: None,
    ) -> None:
        self.node = node
        self.model = model
        self.num_blocks = num_blocks
        self.refresh_period = refresh_period
        self.own_record = own_record
        self.records: dict[str, ServerRecord] = {}
        self.rtts = RttTracker()
        self.bans = BanList()
        self._updated = trio.Event()
        self._refresh_lock = trio.Lock()

    # --- announcing ---------------------------------------------------------------------------

    async def announce(self, blocks: Iterable[int]) -> None:
        """Provide our blocks in the DHT; called every refresh period by the daemon."""
        for block in blocks:
            try:
                await self.node.dht.provide(block_key(self.model, block))
            except Exception as e:  # a DHT hiccup must not stop serving; retried next period
                log.warning("announcing block %d failed: %s", block, e)

    # --- discovering --------------------------------------------------------------------------

    async def find_candidates(self) -> dict[str, PeerInfo]:
        """Peers the DHT lists for any block of the model (not yet confirmed alive)."""
        found: dict[str, PeerInfo] = {}

        async def look_up(block: int) -> None:
            key = block_key(self.model, block)
            # find_providers answers from the local store alone when it holds any record for
            # the key, so forget local copies to ask the network (notes/libp2p.md, pitfall 5).
            store = self.node.dht.provider_store
            local_key = bytes.fromhex(key)
            own = self.own_record()
            if not (own is not None and own.covers(block)):
                store.providers.pop(local_key, None)
            with trio.move_on_after(INFO_TIMEOUT_S):
                try:
                    providers = await self.node.dht.find_providers(key, count=40)
                except Exception as e:
                    log.debug("find_providers for block %d failed: %s", block, e)
                    return
                for info in providers:
                    found.setdefault(info.peer_id.to_string(), info)

        async with trio.open_nursery() as nursery:
            for block in range(self.num_blocks):
                nursery.start_soon(look_up, block)
        for peer_id in list(self.records):  # keep asking peers we know even if the DHT forgot them
            if peer_id not in found:
                addrs = self.node.host.get_peerstore().addrs(ID.from_base58(peer_id))
                found[peer_id] = PeerInfo(ID.from_base58(peer_id), addrs)
        return found

    async def fetch_record(self, peer: PeerInfo) -> ServerRecord | None:
        """Ask a peer for its live record; None if it does not answer well in time."""
        peer_id = peer.peer_id.to_string()
        started = time.perf_counter()
        try:
            with trio.fail_after(INFO_TIMEOUT_S):
                if peer.addrs:
                    self.node.host.get_peerstore().add_addrs(peer.peer_id, peer.addrs, 3600)
                raw = await self.node.host.new_stream(peer.peer_id, [INFO_PROTOCOL])
                stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
                try:
                    await stream.send(wire.InfoRequest())
                    reply = await stream.receive(INFO_TIMEOUT_S)
                finally:
                    await stream.close()
        except (PeerGone, wire.ProtocolError, trio.TooSlowError, OSError, Exception) as e:
            log.debug("info from %s failed: %s", peer_id, e)
            return None
        if not isinstance(reply, wire.InfoResponse):
            return None
        try:
            record = info_to_record(reply.record)
        except ValueError as e:
            log.info("peer %s sent a bad record: %s", peer_id, e)
            return None
        if record.peer_id != peer_id or record.model != self.model:
            return None
        self.rtts.record(peer_id, time.perf_counter() - started)
        # Expiry on our own clock (peers' clocks may be off): a server that stops answering
        # leaves our view after two refresh periods even if no request to it ever fails.
        now = time.time()
        return dataclasses.replace(record, updated_at=now, expires_at=now + 2 * self.refresh_period)

    async def refresh(self) -> None:
        """Rebuild the view: every candidate from the DHT is asked for its record."""
        async with self._refresh_lock:
            candidates = await self.find_candidates()
            own_id = self.node.peer_id.to_string()
            fresh: dict[str, ServerRecord] = {}

            async def confirm(peer_id: str, info: PeerInfo) -> None:
                record = await self.fetch_record(info)
                if record is not None:
                    fresh[peer_id] = record

            async with trio.open_nursery() as nursery:
                for peer_id, info in candidates.items():
                    if peer_id != own_id:
                        nursery.start_soon(confirm, peer_id, info)
            own = self.own_record()
            if own is not None:
                fresh[own_id] = own
            gone = set(self.records) - set(fresh)
            if gone:
                log.info("servers left the swarm view: %s", ", ".join(sorted(gone)))
            self.records = fresh
            self._updated.set()
            self._updated = trio.Event()

    def report_failure(self, peer_id: str) -> None:
        """A server failed us: drop it from the view at once and ban it with backoff (the next
        refresh re-adds it if it answers, and routing uses it again once the ban ends)."""
        self.records.pop(peer_id, None)
        self.rtts.record_failure(peer_id)
        self.bans.record_failure(peer_id, time.time())

    def report_success(self, peer_id: str) -> None:
        self.bans.record_success(peer_id)

    def plan(self, start: int = 0, end: int | None = None, **kwargs: object) -> Route:
        """The cheapest route over [start, end) in the current view (NoRouteError if none)."""
        return plan_route(
            self.snapshot(),
            start,
            end,
            rtts=self.rtts,
            bans=self.bans,
            now=time.time(),
            **kwargs,  # type: ignore[arg-type]
        )

    def snapshot(self) -> SwarmSnapshot:
        now = time.time()
        records = list(self.records.values())
        return SwarmSnapshot.from_records(self.model, self.num_blocks, records, now=now)

    async def run(self, rng: random.Random | None = None) -> None:
        """Refresh forever, every refresh period with a little jitter so peers spread out."""
        rng = rng or random.Random()
        while True:
            try:
                await self.refresh()
            except Exception as e:
                log.warning("swarm refresh failed: %s", e)
            await trio.sleep(self.refresh_period * rng.uniform(0.8, 1.0))

    async def wait_for(self, predicate: Callable[[SwarmSnapshot], bool], timeout: float) -> bool:
        """Refresh until `predicate(snapshot)` holds or `timeout` passes."""
        with trio.move_on_after(timeout):
            while not predicate(self.snapshot()):
                await self.refresh()
                if not predicate(self.snapshot()):
                    await trio.sleep(min(0.5, self.refresh_period))
            return True
        return False
