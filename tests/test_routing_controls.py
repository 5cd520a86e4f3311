"""Routing controls end to end: allowed_servers, blocked_servers, max_retries, connect_timeout
and request_timeout through the client library (and the CLI's flags), on a live swarm where every
block has two servers: a holds 0:30, b 0:15 and c 15:30. Generations go through a's socket."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from typer.testing import CliRunner

import cli
import wire
from peerd.devtools.localswarm import DaemonProcess, LocalSwarm
from peerd.sdk.client import BadRouteOptions, Client, PeerdError

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PROMPT = "Once upon a time"
TOKENS = 3
UNKNOWN = "12D3KooWPTCWpA2Xi73a1uREdWgF3ssywwth3Sd8A7M5vm3zgdKp"  # well-formed, in no swarm


@pytest.fixture(scope="module")
def overlap() -> Iterator[dict[str, DaemonProcess]]:
    swarm = LocalSwarm(refresh_period=1.0)
    try:
        swarm.start("a", "0:30")
        with ThreadPoolExecutor(2) as pool:
            for started in [
                pool.submit(swarm.start, n, b) for n, b in (("b", "0:15"), ("c", "15:30"))
            ]:
                started.result()
        daemons = {d.name: d for d in swarm.daemons}
        with Client(daemons["a"].socket) as client:  # a sees all three before tests start
            for _ in range(100):
                if len(client.status().swarm) == 3:
                    break
                time.sleep(0.2)
        yield daemons
    finally:
        swarm.stop()


def hops(route: tuple[str, ...]) -> list[tuple[str, int, int]]:
    parsed = []
    for hop in route:
        m = re.fullmatch(r"(\S+)\[(\d+):(\d+)\)", hop)
        assert m, hop
        parsed.append((m.group(1), int(m.group(2)), int(m.group(3))))
    return parsed


def generate(daemons: dict[str, DaemonProcess], **routing: object) -> list[tuple[str, int, int]]:
    with Client(daemons["a"].socket, **routing) as client:  # type: ignore[arg-type]
        result = client.generate_full(PROMPT, max_new_tokens=TOKENS)
        assert len(result.token_ids) == TOKENS
        return hops(client.last_route)


def steps_served(daemon: DaemonProcess) -> int:
    with Client(daemon.socket) as client:
        return client.status().steps_served


def test_blocked_servers_are_never_in_the_route(overlap: dict[str, DaemonProcess]) -> None:
    a, b, c = overlap["a"], overlap["b"], overlap["c"]
    before = {d.name: steps_served(d) for d in (a, b, c)}
    route = generate(overlap, blocked_servers=[a.peer_id])
    assert route == [(b.peer_id, 0, 15), (c.peer_id, 15, 30)]
    after = {d.name: steps_served(d) for d in (a, b, c)}
    assert after["a"] == before["a"]  # the blocked server ran no step at all
    assert after["b"] > before["b"] and after["c"] > before["c"]
    route = generate(overlap, blocked_servers=[b.peer_id, c.peer_id])
    assert route == [(a.peer_id, 0, 30)]


def test_allowed_servers_one_per_span_are_exactly_the_route(
    overlap: dict[str, DaemonProcess],
) -> None:
    a, b, c = overlap["a"], overlap["b"], overlap["c"]
    assert generate(overlap, allowed_servers=[b.peer_id, c.peer_id]) == [
        (b.peer_id, 0, 15),
        (c.peer_id, 15, 30),
    ]
    assert generate(overlap, allowed_servers=[a.peer_id]) == [(a.peer_id, 0, 30)]
    # The same through an inference session (what the transformers-compatible model opens).
    with Client(a.socket, allowed_servers=[c.peer_id, b.peer_id]) as client:
        session = client.open_session(8)
        assert hops(client.last_route) == [(b.peer_id, 0, 15), (c.peer_id, 15, 30)]
        hidden = torch.zeros(1, 2, client.welcome.hidden_size)
        assert client.step(session, hidden).shape == hidden.shape
        client.close_session(session)


def test_allowed_servers_that_leave_blocks_uncovered_fail_at_once(
    overlap: dict[str, DaemonProcess],
) -> None:
    b, c = overlap["b"], overlap["c"]
    with pytest.raises(PeerdError) as info:
        generate(overlap, allowed_servers=[b.peer_id, UNKNOWN])
    assert info.value.code == wire.ErrorCode.NO_ROUTE
    message = str(info.value)
    assert "allowed_servers leave blocks 15-29" in message
    assert c.peer_id in message and f"{UNKNOWN} is not in the swarm" in message


def test_malformed_peer_ids_are_refused_before_anything_is_sent(
    overlap: dict[str, DaemonProcess],
) -> None:
    with pytest.raises(BadRouteOptions, match="'12D3KooWnope' is not a peer id"):
        Client(overlap["a"].socket, blocked_servers=["12D3KooWnope"])
    runner = CliRunner()
    result = runner.invoke(
        cli.app,
        ["generate", "hi", "--socket", str(overlap["a"].socket), "--allowed-server", "0xbad"],
    )
    assert result.exit_code == 2
    assert "allowed_servers: '0xbad' is not a peer id" in result.output


def test_cli_show_route_prints_the_route_used(overlap: dict[str, DaemonProcess]) -> None:
    a, b, c = overlap["a"], overlap["b"], overlap["c"]
    result = CliRunner().invoke(
        cli.app,
        [
            "generate",
            PROMPT,
            "--socket",
            str(a.socket),
            "--max-new-tokens",
            str(TOKENS),
            "--blocked-server",
            a.peer_id,
            "--show-route",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"route: {b.peer_id}[0:15) -> {c.peer_id}[15:30)" in result.output


def test_timeouts_and_max_retries_bound_a_session(overlap: dict[str, DaemonProcess]) -> None:
    """Last: it kills c (and its timeouts get b banned in a's view for a few seconds)."""
    a, b, c = overlap["a"], overlap["b"], overlap["c"]
    remote = [b.peer_id, c.peer_id]
    # A step may not take a millisecond on a remote server, nor may dialing one and opening a
    # session there; with max_retries=0 the first such failure ends the request.
    for limit in ("request_timeout", "connect_timeout"):
        with pytest.raises(PeerdError) as info:
            generate(overlap, allowed_servers=remote, max_retries=0, **{limit: 1e-4})
        assert info.value.code == wire.ErrorCode.INFERENCE_FAILED, (limit, info.value)
        assert "more than max_retries=0 allows" in str(info.value)

    with Client(a.socket, blocked_servers=[a.peer_id], max_retries=0) as client:
        session = client.open_session(8)
        assert hops(client.last_route) == [(b.peer_id, 0, 15), (c.peer_id, 15, 30)]
        c.kill()
        with pytest.raises(PeerdError) as info:
            client.step(session, torch.zeros(1, 1, client.welcome.hidden_size))
        assert info.value.code == wire.ErrorCode.INFERENCE_FAILED
        assert "more than max_retries=0 allows" in str(info.value)
