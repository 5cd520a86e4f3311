"""The swarm monitor, like health.petals.dev: which servers hold which blocks of the daemon's
model, each block's throughput, direct or relayed peers, and the blocks nobody serves; as JSON at
/api/v1/swarm and as a page at /swarm that polls it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

import wire
from routing.planner import NoRouteError
from routing.records import ROUTABLE_STATES, SwarmSnapshot, contiguous_ranges

PAGE = Path(__file__).parent / "static" / "swarm.html"

DEFAULT_REFRESH_S = 5.0
"""How often the page asks for fresh data: a daemon re-checks its servers every refresh period
(60 s by default), so a few seconds shows a change soon after the daemon sees it."""


def swarm_report(
    status: wire.StatusResponse, snapshot: SwarmSnapshot, refresh_s: float
) -> dict[str, Any]:
    """The monitor's JSON: per model, every block with its servers and throughput (summed over
    the online servers holding it; 0 and `covered: false` when none does), and every server."""
    throughputs, counts = snapshot.coverage(states=ROUTABLE_STATES)
    routable = [r for r in snapshot.records if r.state in ROUTABLE_STATES]
    blocks = [
        {
            "index": block,
            "covered": counts[block] > 0,
            "throughput": round(throughputs[block], 3),
            "servers": sorted(r.peer_id for r in routable if r.covers(block)),
        }
        for block in range(snapshot.num_blocks)
    ]
    rtts = dict(zip((info.peer_id for info in status.swarm), status.rtts, strict=False))
    servers = [
        {
            "peer_id": r.peer_id,
            "start": r.start,
            "end": r.end,
            "state": r.state.value,
            "throughput": round(r.throughput, 3),
            "relayed": r.relayed,
            "rtt_ms": round(rtts[r.peer_id] * 1000, 2) if rtts.get(r.peer_id, -1) >= 0 else None,
            "free_cache_tokens": r.free_cache_tokens,
            "version": r.version,
            "public_name": r.public_name,
            "is_this_daemon": r.peer_id == status.peer_id,
        }
        for r in sorted(snapshot.records, key=lambda r: (r.start, r.end, r.peer_id))
    ]
    missing = contiguous_ranges(block for block, count in enumerate(counts) if count == 0)
    model = {
        "model": snapshot.model,
        "num_blocks": snapshot.num_blocks,
        "covered_blocks": sum(1 for count in counts if count > 0),
        "missing_blocks": [[a, b] for a, b in missing],
        "message": str(NoRouteError(snapshot.model, missing, {})) if missing else None,
        "blocks": blocks,
        "servers": servers,
    }
    return {
        "peer_id": status.peer_id,
        "version": status.version,
        "refresh_s": refresh_s,
        "updated_at": time.time(),
        "models": [model],
    }


async def swarm_json(request: Request) -> Response:
    status, snapshot = await request.app.state.link.swarm_view()
    return JSONResponse(swarm_report(status, snapshot, request.app.state.swarm_refresh_s))


async def swarm_page(request: Request) -> Response:
    return FileResponse(PAGE, headers={"Cache-Control": "no-cache"})
