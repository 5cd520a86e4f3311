"""Feeds our block server's standing (peerd.server.standing) from this daemon's swarm view: who
serves our model now, reachable, how fast our own steps found it, and whom our calls or spot
checks caught failing or lying.

The server room knows nothing of the swarm view (it may not import session), so the daemon looks
at the view every STANDING_LOOK_S and tells the server's Standing what it saw.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import trio

from peerd.server.standing import Standing
from peerd.session.swarm import SwarmView
from routing.bans import BanList

if TYPE_CHECKING:
    from peerd.server.block_server import BlockServer

# What servers said our standing was counts this long (`peerd status`): older sessions' answers
# may be from before we served, or stopped.
STANDING_SEEN_S = 600.0
# Seconds between looks at the swarm view: well under the standing's qualify and decay periods,
# so a peer's standing follows the view within a few seconds.
STANDING_LOOK_S = 5.0


class Contradictions:
    """Peers that failed one of our calls since the last look, or are banned as liars."""

    def __init__(self) -> None:
        self._bans_seen: dict[str, float | None] = {}  # peer -> the ban we last saw

    def since_last(self, bans: BanList, peers: set[str], now: float) -> set[str]:
        """Of `peers` (and those failing before), the ones contradicted since the last call: a
        new failure (its ban moved) or a liar's ban. `now` is on the wall clock, as bans are."""
        out = set()
        for peer in peers | set(self._bans_seen):
            until = bans.banned_until(peer)
            if bans.is_liar(peer, now) or (
                until is not None and until != self._bans_seen.get(peer)
            ):
                out.add(peer)
            if until is None:
                self._bans_seen.pop(peer, None)
            else:
                self._bans_seen[peer] = until
        return out


def look(standing: Standing, swarm: SwarmView, contradictions: Contradictions) -> None:
    """Tell `standing` what the swarm view shows now."""
    own = swarm.node.peer_id.to_string()
    records = [r for r in swarm.records.values() if r.peer_id != own]
    known = {r.peer_id for r in records} | set(swarm.bans.banned(time.time()))
    standing.observe_swarm(
        records,
        model=swarm.model,
        num_blocks=swarm.num_blocks,
        measured=swarm.speeds,
        contradicted=contradictions.since_last(swarm.bans, known, time.time()),
        unreachable=swarm.missed,
    )


async def watch_standing(standing: Standing, swarm: SwarmView) -> None:
    """Look at the swarm view every STANDING_LOOK_S, forever."""
    contradictions = Contradictions()
    while True:
        look(standing, swarm, contradictions)
        await trio.sleep(STANDING_LOOK_S)


def standing_seen(swarm: SwarmView | None, now: float | None = None) -> float:
    """Our standing as servers grant it: the median of what the servers our sessions opened on
    in the last STANDING_SEEN_S said (their session_opened replies); 0 with none."""
    if swarm is None:
        return 0.0
    now = time.time() if now is None else now
    seen = swarm.standing_seen
    for peer in [p for p, (_, at) in seen.items() if now - at > STANDING_SEEN_S]:
        del seen[peer]
    return statistics.median(value for value, _ in seen.values()) if seen else 0.0


def contributor_share(server: BlockServer | None) -> float:
    """The share of our block server's work (tokens run) that went to peers with standing."""
    priority = server.batcher.priority if server is not None else None
    return priority.contributor_share() if priority is not None else 0.0
