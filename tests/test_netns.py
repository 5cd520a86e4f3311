"""The netns topology (peerd.devtools.netns) behaves like the internet it stands for: home hosts
reach
public hosts through their NAT routers, nothing reaches into a home unasked, and teardown
leaves no namespace behind (nor any left by a run that died)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from peerd.devtools import netns
from peerd.devtools.netns import Host, Nat, Topology


def _unavailable() -> str | None:
    try:
        netns.check_available()
    except netns.NetnsUnavailable as e:
        return str(e)
    return None


@pytest.fixture
def topo() -> Iterator[Topology]:
    if reason := _unavailable():
        pytest.skip(reason)
    with netns.topology() as t:
        yield t


# A TCP server that answers each connection with the address the connection came from.
_ECHO_PEER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(8); print("ready", flush=True)
while True:
    c, addr = s.accept(); c.sendall(f"{addr[0]}:{addr[1]}".encode()); c.close()
"""

_DIAL = """
import socket, sys
out = []
for _ in range(2):
    try:
        c = socket.create_connection((sys.argv[1], 7000), timeout=2)
        out.append(c.recv(100).decode()); c.close()
    except OSError as e:
        out.append(f"error:{type(e).__name__}")
print(" ".join(out))
"""


def _serve(host: Host) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*host.exec_args(), sys.executable, "-c", _ECHO_PEER, host.ip],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _dial(src: Host, dst_ip: str) -> list[str]:
    done = subprocess.run(
        [*src.exec_args(), sys.executable, "-c", _DIAL, dst_ip],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout.split()


@pytest.mark.netns
@pytest.mark.slow
def test_nat_routers_map_outbound_and_drop_inbound(topo: Topology) -> None:
    public = topo.add_public("relay")
    cone = topo.add_home("h1", Nat.CONE)
    symmetric = topo.add_home("h2", Nat.SYMMETRIC)
    servers = [_serve(public), _serve(cone)]
    try:
        # Outbound through either NAT: the public host sees the router's address.
        seen = _dial(cone, public.ip)
        gw1 = topo.hosts["h1gw"].ip
        assert all(s.startswith(f"{gw1}:") for s in seen), seen
        seen2 = _dial(symmetric, public.ip)
        gw2 = topo.hosts["h2gw"].ip
        assert all(s.startswith(f"{gw2}:") for s in seen2), seen2
        # Nothing reaches into a home: not its private address, not its router unasked.
        assert all(s.startswith("error:") for s in _dial(public, cone.ip))
        assert all(s.startswith("error:") for s in _dial(symmetric, gw1))
    finally:
        for proc in servers:
            proc.kill()
            proc.wait(10)


@pytest.mark.netns
@pytest.mark.slow
def test_teardown_removes_every_namespace_and_stale_ones() -> None:
    if reason := _unavailable():
        pytest.skip(reason)
    with netns.topology() as t:
        t.add_home("h1", Nat.CONE)
        names = list(t.namespaces)
        assert len(names) == 3  # the internet, the router, the home host
        # A run whose process died: its namespaces go, a live run's stay. Every Topology.up()
        # removes stale namespaces too, and the tests run on two workers: the stale one may be
        # gone by another run's hand before ours looks, so what counts is that it is gone.
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = Topology(run_id=dead.pid)
        stale.up()
        time.sleep(0.1)
        removed = netns.remove_stale()
        assert not set(removed) & set(names)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale.internet not in left
        assert all(name in left for name in names)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in left for name in names)


_PING_PONG = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 7000), timeout=5)
c.close()
rtts = []
for _ in range(8):
    started = time.perf_counter()
    c = socket.create_connection((sys.argv[1], 7000), timeout=5)
    c.recv(100)
    c.close()
    rtts.append(time.perf_counter() - started)
print(statistics.median(rtts))
"""


def _may_run_realtime() -> bool:
    """Whether a process started here may take a real-time priority (root without CAP_SYS_NICE,
    as in some containers, may not: the delayer then keeps the normal one, by design)."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


@pytest.mark.netns
@pytest.mark.slow
def test_shaped_links_delay_each_direction(topo: Topology) -> None:
    a = topo.add_public("a")
    b = topo.add_public("b")
    server = _serve(b)
    try:
        kinds = {topo.shape(a, delay_ms=25, rate_mbit=100), topo.shape(b, 25, 100)}
        assert kinds <= {"netem", "nfqueue"}
        done = subprocess.run(
            [*a.exec_args(), sys.executable, "-c", _PING_PONG, b.ip],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # A TCP connect and the first reply: SYN, SYN-ACK, then data after the ACK, so two
        # round trips of 25 ms each way.
        median = float(done.stdout)
        assert 0.1 <= median < 0.13, (kinds, median)
        if "nfqueue" in kinds and _may_run_realtime():  # netem._realtime_priority
            policies = {os.sched_getscheduler(d.pid) for d in topo._delayers}
            assert policies == {os.SCHED_FIFO}
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.parametrize("ids", [[7], [1, 2, 3]])
def test_delayer_reads_packet_ids_from_nfnetlink_messages(ids: list[int]) -> None:
    from peerd.devtools import netem

    def queued(packet_id: int) -> bytes:
        # packet id, hardware protocol (IPv4), netfilter hook
        header = struct.pack("!IHB", packet_id, 0x0800, 3)
        return netem._message(netem.NFQNL_MSG_PACKET, 0, netem._attr(netem.NFQA_PACKET_HDR, header))

    data = b"".join(queued(packet_id) for packet_id in ids)
    assert netem._packet_ids(data) == ids


def test_delayer_raises_the_kernels_refusal() -> None:
    from peerd.devtools import netem

    header = struct.pack("=IHHII", 36, netem.NLMSG_ERROR, 0, 1, 0)
    error = header + struct.pack("=i", -1) + bytes(16)
    with pytest.raises(OSError, match="refused"):
        netem._packet_ids(error)


# A libp2p node (peerd.node.p2p.open_node) that joins `peer` if given, then prints what AutoNAT
# answers about it, as long as it gets a verdict within the deadline.
_AUTONAT_NODE = """
import sys, trio
from libp2p.crypto.ed25519 import create_new_key_pair
from peerd.node.p2p import open_node, parse_peer_maddr

async def main(ip, peer):
    # Every interface, as volunteers run it: peers dial back at the IP they see us at.
    async with open_node(create_new_key_pair(), ["/ip4/0.0.0.0/tcp/0"]) as node:
        print(node.maddrs()[0].replace("/ip4/0.0.0.0/", f"/ip4/{ip}/"), flush=True)
        if peer:
            await node.connect(parse_peer_maddr(peer))
        with trio.move_on_after(40):
            while (verdict := await node.check_reachability()).value == "unknown":
                await trio.sleep(0.5)
        print(verdict.value, flush=True)
        await trio.sleep(3 if peer else 10)  # stay up to answer the other side

trio.run(main, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
"""


def test_autonat_tells_a_public_host_from_one_behind_nat(topo: Topology) -> None:
    public = topo.add_public("pub")
    home = topo.add_home("h1", Nat.CONE)

    def node(host: Host, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*host.exec_args(), sys.executable, "-c", _AUTONAT_NODE, host.ip, *args],
            stdout=subprocess.PIPE,
            text=True,
        )

    first = node(public)
    assert first.stdout is not None
    second = node(home, first.stdout.readline().strip())
    try:
        out, _ = second.communicate(timeout=90)
        assert out.split()[-1] == "private", out
        assert first.stdout.readline().strip() == "public"
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait(10)
