"""Joining a swarm as a person does it, in process: the addresses a daemon gives out are ones
another machine can dial (peerd.node.addresses), a server that says it joined is in the others'
views at once (after they asked it themselves), one that says it leaves is out at once and stays
out, and `peerd status` counts the blocks nobody serves at the end of the model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

import blocks
import wire
from peerd.node.addresses import BadAnnounceAddr, announced_addrs, check_announce
from peerd.node.p2p import JOINED_PROTOCOL, LEAVING_PROTOCOL, open_node
from peerd.sdk.terminal import format_status
from peerd.session.swarm import INFO_TIMEOUT_S, SwarmView
from routing.records import ServerRecord, info_to_record, record_to_info
from tests.memnet import TINY_BLOCKS, TINY_MODEL, MemNet, open_memnet

IPS = {4: ["198.51.100.7", "10.0.0.5"], 6: ["2001:db8::7"]}


def test_every_interface_is_announced_as_this_machines_ips() -> None:
    listen = ["/ip4/0.0.0.0/tcp/4100", "/ip6/::/tcp/4101", "/ip4/127.0.0.1/tcp/4102"]
    assert announced_addrs(listen, ips=IPS) == [
        "/ip4/198.51.100.7/tcp/4100",
        "/ip4/10.0.0.5/tcp/4100",
        "/ip6/2001:db8::7/tcp/4101",
        "/ip4/127.0.0.1/tcp/4102",  # listened on by name: a local swarm
    ]


def test_public_ip_goes_first_and_announce_maddrs_replace_all() -> None:
    listen = ["/ip4/0.0.0.0/tcp/4100", "/ip4/127.0.0.1/tcp/4102"]
    # The forwarded port is ours; a loopback listener is not what a router forwards to.
    assert announced_addrs(listen, public_ip="203.0.113.9", ips=IPS) == [
        "/ip4/203.0.113.9/tcp/4100",
        "/ip4/198.51.100.7/tcp/4100",
        "/ip4/10.0.0.5/tcp/4100",
        "/ip4/127.0.0.1/tcp/4102",
    ]
    announce = ["/dns4/peerd.example.org/tcp/443", "/ip4/203.0.113.9/tcp/31337/p2p/12D3KooWx"]
    assert announced_addrs(listen, announce=announce, ips=IPS) == [
        "/dns4/peerd.example.org/tcp/443",
        "/ip4/203.0.113.9/tcp/31337",
    ]


@pytest.mark.parametrize(
    ("announce", "public_ip", "says"),
    [
        (["not an address"], None, "expected a TCP multiaddr"),
        (["/ip4/0.0.0.0/tcp/1"], None, "every interface"),
        ([], "example.org", "expected an IP address"),
        ([], "127.0.0.1", "cannot dial"),
    ],
)
def test_undialable_announcements_are_refused(
    announce: list[str], public_ip: str | None, says: str
) -> None:
    with pytest.raises(BadAnnounceAddr, match=says):
        check_announce(announce, public_ip)


async def test_a_node_gives_out_no_unspecified_address() -> None:
    async with open_node(create_new_key_pair(), ["/ip4/0.0.0.0/tcp/0"], mdns=False) as node:
        addrs = node.maddrs()
        given = [str(a) for a in node.host.get_addrs()]  # identify, DHT records
    assert addrs and given
    for addr in addrs + given:
        assert "/ip4/0.0.0.0/" not in addr and addr.endswith(f"/p2p/{node.peer_id}"), addr


async def test_who_joined_or_leaves_is_the_authenticated_peer_not_a_claim() -> None:
    heard: list[tuple[str, str]] = []
    async with (
        open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as a,
        open_node(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as b,
    ):
        for protocol in (JOINED_PROTOCOL, LEAVING_PROTOCOL):

            async def note(peer: ID, protocol: str = protocol) -> None:
                heard.append((protocol, peer.to_string()))

            b.on_told(protocol, note)
        b_addr = b.maddrs()[0]
        a.remember(b.peer_id, [b_addr])
        assert await a.tell([b.peer_id, a.peer_id], JOINED_PROTOCOL, timeout=10) == 1
        assert await a.tell([b.peer_id], LEAVING_PROTOCOL, timeout=10) == 1
        with trio.fail_after(10):
            while len(heard) < 2:
                await trio.sleep(0.01)
    assert heard == [(JOINED_PROTOCOL, str(a.peer_id)), (LEAVING_PROTOCOL, str(a.peer_id))]


async def test_a_join_is_checked_live_and_a_leave_keeps_the_server_out(tiny_llama: Path) -> None:
    async with open_memnet() as net:
        net.serve("s1", blocks.load_span(tiny_llama, 0, TINY_BLOCKS))
        view = SwarmView(net.node("client"), TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]
        s1 = net.peer_id("s1")
        # A peer that serves nothing (or is gone) is not added for saying it joined.
        assert not await view.heard_join(net.peer_id("nobody"))
        assert await view.heard_join(s1)
        assert view.records[s1].state is wire.ServerState.ONLINE
        # A second join soon after is not looked up again (a flood costs one look-up).
        del view.records[s1]
        assert not await view.heard_join(s1)
        assert s1 not in view.records
        view.records[s1] = net.server("s1").record()

        view.heard_leave(s1)
        assert s1 not in view.records and view.has_left(s1)
        # It still answers `info` (draining) and the DHT still lists it: a refresh's look-up
        # finds it, and leaves it out.
        fresh: dict[str, object] = {}
        await view._confirm({s1: PeerInfo(ID.from_base58(s1), [])}, fresh)  # type: ignore[arg-type]
        assert s1 not in fresh
        # Back again: its own join lets it in (once the rate limit allows a look-up), even
        # while a refresh runs that looked before it was up: what that refresh found replaces
        # the view at its end, and the server that joined meanwhile stays.
        view._join_heard.clear()
        async with view._refresh_lock:
            assert await view.heard_join(s1)
            assert s1 in view.records and not view.has_left(s1)
            found: dict[str, ServerRecord] = {}
            view._settle_presence(found)
        assert s1 in found
        # A refresh that asked it while it was still loading keeps what the join fetched later,
        # not its joining record; a record the refresh fetched after the join's stands.
        online = view.records[s1]
        joining = dataclasses.replace(
            online, state=wire.ServerState.JOINING, updated_at=online.updated_at - 1
        )
        later = dataclasses.replace(online, updated_at=online.updated_at + 1)
        for refresh_found, stands in ((joining, online), (later, later)):
            view._joined_meanwhile[s1] = online
            found = {s1: refresh_found}
            view._settle_presence(found)
            assert found[s1] is stands
        # ...and one that leaves while a refresh runs stays out of what it found.
        view.heard_leave(s1)
        found = {s1: net.server("s1").record()}
        view._settle_presence(found)
        assert not found


def test_status_counts_unserved_blocks_at_the_end_of_the_model() -> None:
    record = record_to_info(_record("12D3KooWfirst", 0, 20))
    status = wire.StatusResponse(
        peer_id="12D3KooWme",
        version="0.1.0",
        uptime_s=5.0,
        swarm=(record,),
        num_blocks=30,
        addrs=("/ip4/198.51.100.7/tcp/4100/p2p/12D3KooWme",),
    )
    text = format_status(status)
    assert "every block is served" not in text
    assert "NOT SERVED: " + ", ".join(str(b) for b in range(20, 30)) in text
    assert "30 blocks" in text
    assert "/ip4/198.51.100.7/tcp/4100/p2p/12D3KooWme" in text


def _record(peer_id: str, start: int, end: int) -> ServerRecord:
    return ServerRecord(
        peer_id=peer_id,
        model="smollm2",
        start=start,
        end=end,
        throughput=1.0,
        free_cache_tokens=100,
        state=wire.ServerState.ONLINE,
        version="0.1.0",
        addrs=(f"/ip4/198.51.100.8/tcp/4100/p2p/{peer_id}",),
    )


@pytest.mark.parametrize("name", ["\x1b[2J\x1b[31mpwned", "a\nb", "\u202eevil", "x" * 65])
def test_a_public_name_from_the_wire_is_short_printable_text(name: str) -> None:
    good = record_to_info(_record("12D3KooWfirst", 0, 20)).to_dict()
    assert info_to_record(wire.ServerInfo.from_dict({**good, "public_name": "attic GPU"}))
    with pytest.raises((ValueError, wire.MalformedMessage)):
        info_to_record(wire.ServerInfo.from_dict({**good, "public_name": name}))


def test_the_public_name_is_shown_in_status_and_on_the_swarm_page() -> None:
    from peerd.gateway.monitor import swarm_report
    from routing.records import SwarmSnapshot

    record = dataclasses.replace(_record("12D3KooWfirst", 0, 30), public_name="<b>attic</b> GPU")
    info = record_to_info(record)
    status = wire.StatusResponse(
        peer_id="12D3KooWme", version="0.1.0", uptime_s=5.0, swarm=(info,), num_blocks=30
    )
    assert "...12D3KooWfirst (<b>attic</b> GPU): /ip4/" in format_status(status)
    report = swarm_report(status, SwarmSnapshot.from_records("smollm2", 30, [record]), 2.0)
    # As text: the page puts it in with textContent (peerd/gateway/static/swarm.js), never HTML.
    assert report["models"][0]["servers"][0]["public_name"] == "<b>attic</b> GPU"


async def test_a_slow_server_keeps_its_record_and_a_killed_one_leaves_at_the_next_refresh(
    tiny_llama: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with open_memnet() as net:
        for name in ("slow", "killed"):
            net.serve(name, blocks.load_span(tiny_llama, 0, TINY_BLOCKS))
        slow, killed = net.peer_id("slow"), net.peer_id("killed")
        client = net.node("client")
        view = SwarmView(client, TINY_MODEL, TINY_BLOCKS, refresh_period=60)  # type: ignore[arg-type]

        async def candidates(blocks: object = ()) -> dict[str, PeerInfo]:
            return {p: PeerInfo(ID.from_base58(p), []) for p in (slow, killed)}

        view.find_candidates = candidates  # type: ignore[method-assign]
        await view.refresh()
        assert set(view.records) == {slow, killed}
        view.last_seen.clear()  # (names the addresses it tried from a peerstore memnet lacks)

        dial = client.open_stream

        async def open_stream(peer_id: ID, protocol: str) -> object:
            if peer_id.to_string() == slow:
                await trio.sleep_forever()  # a loaded machine: no answer within INFO_TIMEOUT_S
            return await dial(peer_id, protocol)

        client.open_stream = open_stream  # type: ignore[method-assign]
        net.kill("killed")
        await view.refresh()
        # The server that only timed out stays routable until its record expires; the one whose
        # dial was refused is gone now, not two refresh periods later.
        assert set(view.records) == {slow}
        assert slow in view.missed


def _view_with_a_stalled_server(
    net: MemNet, listed: list[str], others: list[str], stalled: str
) -> SwarmView:
    """A client's view whose directory lists the servers named `listed`, whose DHT names
    `others` too, and to which server `stalled` does not answer (until INFO_TIMEOUT_S)."""
    client = net.node("client")
    view = SwarmView(client, TINY_MODEL, TINY_BLOCKS, refresh_period=60)
    ids = {name: net.peer_id(name) for name in [*listed, *others]}

    async def candidates(blocks: object = ()) -> dict[str, PeerInfo]:
        view._listed = {ids[name]: net.server(name).record() for name in listed}
        return {p: PeerInfo(ID.from_base58(p), []) for p in ids.values()}

    dial = client.open_stream

    async def open_stream(peer_id: ID, protocol: str) -> object:
        if peer_id.to_string() == ids[stalled]:
            await trio.sleep_forever()
        return await dial(peer_id, protocol)

    view.find_candidates = candidates  # type: ignore[method-assign]
    client.open_stream = open_stream
    return view


async def test_a_first_view_is_in_once_the_listed_servers_answered_not_the_gone_peers(
    tiny_llama: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with open_memnet() as net:
        net.serve("listed", blocks.load_span(tiny_llama, 0, TINY_BLOCKS))
        net.serve("gone", blocks.load_span(tiny_llama, 0, TINY_BLOCKS))
        listed, gone = net.peer_id("listed"), net.peer_id("gone")
        # The directory lists one; the routing table knows another, long gone.
        view = _view_with_a_stalled_server(net, ["listed"], ["gone"], "gone")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.refresh)
            await view.ready.wait()
            # Routable before the refresh ends: the gone peer does not hold the first route.
            assert trio.current_time() < 1.0 and view._refresh_lock.locked()
            assert set(view.records) == {listed}
            assert view.directory.stats.first_route_s is not None
        assert trio.current_time() >= INFO_TIMEOUT_S  # the refresh itself waited for it
        assert set(view.records) == {listed}
        # A view that holds servers already is replaced at a refresh's end only.
        view.records.clear()
        view.records[gone] = net.server("gone").record()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.refresh)
            await trio.sleep(1.0)
            assert set(view.records) == {gone}
        assert listed in view.records  # (and gone too, only slow as far as we know)


async def test_a_first_view_does_not_wait_for_a_listed_server_no_route_wants(
    tiny_llama: Path, autojump_clock: trio.abc.Clock
) -> None:
    """The directory lists two servers; the one serving every block answers, the one serving
    half of them does not: no route over the answers and the awaited one would use it (one hop
    beats two at the same round trip), so the first view is in without it."""
    async with open_memnet() as net:
        net.serve("whole", blocks.load_span(tiny_llama, 0, TINY_BLOCKS))
        net.serve("half", blocks.load_span(tiny_llama, 0, TINY_BLOCKS // 2))
        whole = net.peer_id("whole")
        view = _view_with_a_stalled_server(net, ["whole", "half"], [], "half")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.refresh)
            await view.ready.wait()
            assert trio.current_time() < 1.0 and set(view.records) == {whole}
            assert [hop.peer_id for hop in view.plan()] == [whole]
