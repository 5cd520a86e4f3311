"""peerd across real NATs (peerd.netns): a public bootstrap daemon, a server behind a cone NAT,
and two clients, one behind a cone NAT and one behind a symmetric NAT. The server is reachable
only through the relay at first; both clients generate through it; DCUtR turns the cone-cone
pair direct and leaves the symmetric one relayed; killing the relay mid-generation lets the
direct pair go on and ends the relayed one with a clear error, never a hang."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from peerd import netns
from peerd.client import Client, PeerdError
from peerd.localswarm import DaemonProcess, LocalSwarm
from peerd.netns import Nat
from tests.conftest import greedy_continuation

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.multiprocess]

PROMPT = "Once upon a time, there was a little"
# Seconds a generation may take on a loaded 2-core machine before we call it a hang.
GENERATION_DEADLINE_S = 120.0


@dataclass
class NatSwarm:
    relay: DaemonProcess
    server: DaemonProcess
    cone_client: DaemonProcess
    symmetric_client: DaemonProcess


@pytest.fixture(scope="module")
def nat_swarm() -> Iterator[NatSwarm]:
    try:
        netns.check_available()
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))
    with netns.topology() as topo:
        public = topo.add_public("relay")
        home1 = topo.add_home("h1", Nat.CONE)
        home2 = topo.add_home("h2", Nat.CONE)
        home3 = topo.add_home("h3", Nat.SYMMETRIC)
        local = LocalSwarm(refresh_period=2.0)
        try:
            relay = local.start("relay", "none", host=public)
            # The rest only need the relay: start them side by side (each loads torch).
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                server = pool.submit(local.start, "server", "0:30", host=home1)
                cone = pool.submit(local.start, "cone", "none", host=home2)
                symmetric = pool.submit(local.start, "symmetric", "none", host=home3)
                swarm = NatSwarm(relay, server.result(), cone.result(), symmetric.result())
            yield swarm
        finally:
            local.stop()


def _wait_for_server(client: DaemonProcess, server: DaemonProcess, timeout: float = 90) -> Any:
    """The client's status once it routes to `server` (found through the DHT, via the relay)."""
    deadline = time.monotonic() + timeout
    with Client(client.socket) as c:
        while True:
            status = c.status()
            if any(info.peer_id == server.peer_id for info in status.swarm):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"{client.name} never saw the server: {status}")
            time.sleep(1)


def _link(client: DaemonProcess, server: DaemonProcess) -> str:
    with Client(client.socket) as c:
        status = c.status()
    links = dict(zip((i.peer_id for i in status.swarm), status.links, strict=True))
    return links.get(server.peer_id, "unknown")


def _settled_link(client: DaemonProcess, server: DaemonProcess, timeout: float = 20) -> str:
    """The connection kind once DCUtR had its chance (it tries every few seconds)."""
    deadline = time.monotonic() + timeout
    link = _link(client, server)
    while link != "direct" and time.monotonic() < deadline:
        time.sleep(1)
        link = _link(client, server)
    return link


def test_clients_behind_nat_generate_through_a_server_behind_nat(
    nat_swarm: NatSwarm, local_model: Any, tokenizer: Any
) -> None:
    s = nat_swarm
    with Client(s.server.socket) as c:
        server_status = c.status()
    assert server_status.reachability == "private"
    assert server_status.serving is not None and server_status.serving.relayed
    # Its record names it through the relay: that is how peers behind other NATs reach it.
    assert any("/p2p-circuit/" in a for a in server_status.serving.addrs)
    with Client(s.relay.socket) as c:
        assert c.status().reachability == "public"

    expected = tokenizer.decode(greedy_continuation(local_model, tokenizer, PROMPT, 6))
    for client in (s.cone_client, s.symmetric_client):
        status = _wait_for_server(client, s.server)
        assert status.reachability == "private"
        with Client(client.socket) as c:
            text = c.generate(PROMPT, max_new_tokens=6)
        assert text == expected, client.name

    # DCUtR: hole punching through two endpoint-independent NATs gives a direct connection;
    # a symmetric NAT maps the punch to another port than the relay saw, so it stays relayed.
    links = {c.name: _settled_link(c, s.server) for c in (s.cone_client, s.symmetric_client)}
    print(f"connection to the server after DCUtR: {links}")
    assert links == {"cone": "direct", "symmetric": "relayed"}


def test_relay_killed_mid_generation_falls_back_or_fails_clearly(nat_swarm: NatSwarm) -> None:
    s = nat_swarm
    for client in (s.cone_client, s.symmetric_client):
        _wait_for_server(client, s.server)
    started = threading.Barrier(3)
    outcome: dict[str, Any] = {}

    def generate(client: DaemonProcess) -> None:
        tokens = 0
        try:
            with Client(client.socket, timeout=GENERATION_DEADLINE_S) as c:
                for _message in c.stream_tokens(PROMPT, max_new_tokens=24):
                    tokens += 1
                    if tokens == 2:
                        started.wait(GENERATION_DEADLINE_S)
                outcome[client.name] = ("done", tokens)
        except PeerdError as e:
            outcome[client.name] = ("error", f"{e.code}: {e}")
        except threading.BrokenBarrierError:
            outcome[client.name] = ("no tokens", tokens)

    threads = [
        threading.Thread(target=generate, args=(c,), daemon=True)
        for c in (s.cone_client, s.symmetric_client)
    ]
    for t in threads:
        t.start()
    started.wait(GENERATION_DEADLINE_S)
    s.relay.kill()
    began = time.monotonic()
    for t in threads:
        t.join(GENERATION_DEADLINE_S)
    took = time.monotonic() - began
    print(f"after the relay died ({took:.1f} s): {outcome}")
    assert not any(t.is_alive() for t in threads), f"a generation hung: {outcome}"
    # The hole-punched pair does not need the relay any more.
    assert outcome["cone"][0] == "done", outcome
    # The relayed pair either found another way or says clearly that the server is gone.
    kind, detail = outcome["symmetric"]
    assert kind == "done" or (kind == "error" and "serves blocks" in detail), outcome
