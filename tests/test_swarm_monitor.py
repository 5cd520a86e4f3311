"""The gateway's swarm monitor (/swarm and /api/v1/swarm): the report built from a daemon's
status, and the page in headless Chromium on a live three-daemon swarm that loses a server."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import uvicorn

import wire
from peerd.devtools.localswarm import LocalSwarm
from peerd.gateway import create_app
from peerd.gateway.app import uvicorn_config
from peerd.gateway.monitor import swarm_report
from routing.records import SwarmSnapshot, info_to_record
from tests.test_gateway import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, wait_until


def info(peer: str, start: int, end: int, **fields: Any) -> wire.ServerInfo:
    defaults: dict[str, Any] = {
        "model": "m",
        "throughput": 10.0,
        "free_cache_tokens": 100,
        "state": "online",
        "version": "0.1.0",
    }
    return wire.ServerInfo(peer_id=peer, start=start, end=end, **{**defaults, **fields})


def report_of(*infos: wire.ServerInfo, rtts: tuple[float, ...] = ()) -> dict[str, Any]:
    status = wire.StatusResponse(peer_id="a", version="0.1.0", uptime_s=1.0, swarm=infos, rtts=rtts)
    snapshot = SwarmSnapshot.from_records("m", 6, [info_to_record(i) for i in infos])
    return swarm_report(status, snapshot, refresh_s=2.0)


def test_report_per_block_servers_throughput_links_and_holes() -> None:
    report = report_of(
        info("a", 0, 3, throughput=10.0),
        info("b", 1, 3, throughput=5.0, relayed=True),
        info("c", 3, 5, state="draining"),
        rtts=(-1.0, 0.012, 0.003),
    )
    (model,) = report["models"]
    assert report["refresh_s"] == 2.0 and model["num_blocks"] == 6
    blocks = model["blocks"]
    assert [b["servers"] for b in blocks] == [["a"], ["a", "b"], ["a", "b"], [], [], []]
    assert [b["throughput"] for b in blocks] == [10.0, 15.0, 15.0, 0.0, 0.0, 0.0]
    # A draining server takes no new sessions: its blocks count as unserved.
    assert [b["covered"] for b in blocks] == [True, True, True, False, False, False]
    assert model["covered_blocks"] == 3 and model["missing_blocks"] == [[3, 6]]
    assert "peerd start --blocks 3:6" in model["message"]
    servers = {s["peer_id"]: s for s in model["servers"]}
    assert servers["b"]["relayed"] and not servers["a"]["relayed"]
    assert servers["a"]["rtt_ms"] is None and servers["b"]["rtt_ms"] == 12.0
    assert servers["a"]["is_this_daemon"] and servers["c"]["state"] == "draining"


def test_report_of_a_fully_served_model() -> None:
    (model,) = report_of(info("a", 0, 6))["models"]
    assert model["covered_blocks"] == 6 and model["missing_blocks"] == [] and not model["message"]


# --- the page, live -------------------------------------------------------------------------

REFRESH_S = 3.0
"""The page's refresh period in the live test; the daemons re-check their servers every second,
so a killed one leaves their view within one such period and the page shows it by the next."""


@pytest.fixture
def monitored() -> Iterator[tuple[LocalSwarm, str]]:
    swarm = LocalSwarm(refresh_period=1.0)
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    try:
        swarm.start("a", "0:10")
        with ThreadPoolExecutor(2) as pool:
            for started in [
                pool.submit(swarm.start, n, b) for n, b in (("b", "10:20"), ("c", "20:30"))
            ]:
                started.result()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        app = create_app(swarm.daemons[0].socket, swarm_refresh_s=REFRESH_S)
        server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        wait_until(lambda: server is not None and server.started, 60, "uvicorn started")
        yield swarm, f"http://127.0.0.1:{port}"
    finally:
        if server is not None and thread is not None:
            server.should_exit = True
            thread.join(15)
        swarm.stop()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (scripts/setup.sh)")
def test_swarm_page_shows_coverage_and_turns_a_killed_servers_blocks_red(
    monitored: tuple[LocalSwarm, str],
) -> None:
    from playwright.sync_api import sync_playwright

    swarm, url = monitored
    c = next(d for d in swarm.daemons if d.name == "c")
    ARTIFACTS.mkdir(exist_ok=True)
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{url}/swarm")
            page.wait_for_function(
                "document.querySelectorAll('td.block.covered').length === 30", timeout=60_000
            )
            assert page.locator("td.block.uncovered").count() == 0
            assert "30 of 30 blocks served" in page.inner_text(".coverage")
            assert page.inner_text("#refresh") == f"{REFRESH_S:g}"
            for daemon in swarm.daemons:  # a row per server, and which one this daemon is
                assert page.locator(f"table.servers tr[data-peer='{daemon.peer_id}']").count() == 1
            assert page.locator("table.servers .badge.direct").count() == 3
            page.screenshot(path=str(ARTIFACTS / "swarm-monitor.png"), full_page=True)

            # The JSON says the same.
            data = httpx.get(f"{url}/api/v1/swarm", timeout=30).json()
            (model,) = data["models"]
            assert model["covered_blocks"] == 30
            assert {b["servers"][0] for b in model["blocks"][20:]} == {c.peer_id}
            assert all(b["throughput"] > 0 for b in model["blocks"])

            c.kill()
            killed = time.monotonic()
            page.wait_for_function(
                "[...document.querySelectorAll('td.block.uncovered')]"
                ".map(td => td.dataset.block).join(',') === "
                f"'{','.join(str(b) for b in range(20, 30))}'",
                timeout=int(4 * REFRESH_S * 1000) + 30_000,
            )
            took = time.monotonic() - killed
            print(f"blocks 20-29 turned red {took:.1f} s after the kill (refresh {REFRESH_S} s)")
            page.screenshot(path=str(ARTIFACTS / "swarm-monitor-lost-20-30.png"), full_page=True)
            assert page.locator("td.block.covered").count() == 20
            assert "peerd start --blocks 20:30" in page.inner_text(".coverage")
            assert took <= 2 * REFRESH_S, f"blocks turned red {took:.1f} s after the kill"
        finally:
            browser.close()
