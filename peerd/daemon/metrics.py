"""Prometheus metrics of a running daemon: its counters in the text exposition format (version
0.0.4), served by a tiny trio HTTP responder on 127.0.0.1 (`peerd start --metrics-port P`).

`render` is a pure function of a list of `Metric`s; `daemon_metrics` reads them off a daemon.
Only GET /metrics is answered; the port is bound to loopback because the numbers say who uses
this server and how much.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from peerd.daemon.local_api import LocalApi
    from peerd.daemon.main import Daemon
    from peerd.server.block_server import BlockServer

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A scrape request is a few hundred bytes; anything bigger is not a scraper.
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
# tokens/s is averaged over this window, sampled once a second.
RATE_WINDOW_S = 10.0


@dataclass
class Metric:
    name: str
    kind: str  # "counter" | "gauge"
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> Metric:
        self.samples.append((labels, float(value)))
        return self


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value == int(value) and abs(value) < 2**53 else repr(value)


def render(metrics: list[Metric]) -> str:
    """The Prometheus text format: HELP and TYPE lines, then one line per sample."""
    lines: list[str] = []
    for metric in metrics:
        lines.append(f"# HELP {metric.name} {metric.help}")
        lines.append(f"# TYPE {metric.name} {metric.kind}")
        for labels, value in metric.samples:
            shown = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(labels.items()))
            lines.append(f"{metric.name}{{{shown}}} {_number(value)}" if shown else
                         f"{metric.name} {_number(value)}")  # fmt: skip
    return "\n".join(lines) + "\n"


class TokenRate:
    """Tokens per second over the last RATE_WINDOW_S, from a counter sampled every second."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def record(self, now: float, total: int) -> None:
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def daemon_metrics(daemon: Daemon, rate: TokenRate) -> list[Metric]:
    """Everything an operator graphs, read off a running daemon."""
    server = daemon.server
    return [
        _identity(daemon),
        *_sessions(server),
        *_load(server, rate),
        *_node(daemon),
        *_local_api(daemon.api),
        *([_state(server)] if server is not None else []),
        _errors(server),
        *_standing(server),
        *_discovery(daemon),
    ]


def _discovery(daemon: Daemon) -> list[Metric]:
    """What finding servers through the DHT's signed records cost (peerd.session.directory),
    in all and until the first route could be planned."""
    if daemon.swarm is None:
        return []
    stats = daemon.swarm.directory.stats
    board = daemon.swarm.directory.board
    out = [
        Metric("peerd_discovery_lookups_total", "counter", "Kademlia look-ups of shard keys.").add(
            stats.lookups
        ),
        Metric(
            "peerd_discovery_lookup_messages_total",
            "counter",
            "Kademlia queries those look-ups sent.",
        ).add(stats.lookup_messages),
        Metric(
            "peerd_discovery_record_bytes_total", "counter", "Bytes of signed records fetched."
        ).add(stats.record_bytes),
        Metric("peerd_discovery_contacts_total", "counter", "Servers asked for their record.").add(
            stats.contacts
        ),
        Metric(
            "peerd_records_held", "gauge", "Signed server records this daemon keeps as a DHT node."
        ).add(sum(len(shard) for shard in board.shards.values()) if board else 0),
        Metric(
            "peerd_records_refused_total", "counter", "Records refused as forged or malformed."
        ).add(board.refused if board else 0),
        Metric(
            "peerd_record_puts_throttled_total",
            "counter",
            "Record puts refused unchecked: their peer put more than PUT_RATE_PER_S a second.",
        ).add(board.throttled if board else 0),
    ]
    if stats.first_route_s is not None:
        out.append(
            Metric(
                "peerd_discovery_first_route_seconds",
                "gauge",
                "Seconds from the swarm view's start until a route over every block could be "
                "planned.",
            ).add(stats.first_route_s)
        )
        for name, value in stats.first.items():
            out.append(
                Metric(
                    f"peerd_discovery_first_route_{name}",
                    "gauge",
                    f"{name.replace('_', ' ').capitalize()} until the first route.",
                ).add(value)
            )
    return out


def _standing(server: BlockServer | None) -> list[Metric]:
    """Standing (peerd.server.standing): the peers that contribute as this server sees them, and
    the work it gave them against the pure takers."""
    work = Metric(
        "peerd_priority_work_total",
        "counter",
        "Work this server gave by class (contributor: peers with standing; taker: the others); "
        "queue=turns: tokens run through its blocks, queue=cache: cache tokens admitted.",
    )
    share = Metric(
        "peerd_contributor_work_share",
        "gauge",
        "Share of this server's work given to contributors so far, by queue.",
    )
    if server is None:
        return [work, share]
    for queue, priority in (
        ("turns", server.batcher.priority),
        ("cache", server.admission.priority),
    ):
        if priority is None:
            continue
        for kind, total in priority.totals.items():
            work.add(total, queue=queue, **{"class": kind})
        share.add(priority.contributor_share(), queue=queue)
    contributors = Metric(
        "peerd_contributors", "gauge", "Peers with a standing above zero on this server."
    ).add(len(server.standing.standings()))
    return [work, share, contributors, *_reservation(server), *_step_times(server)]


def _step_times(server: BlockServer) -> list[Metric]:
    """Where steps spent their time here, by class: a token's latency, hop by hop."""
    seconds = Metric(
        "peerd_step_seconds_total",
        "counter",
        "Time the finished inference steps spent on this server's batcher by class; "
        "part=forward: in the forwards that ran them, part=wait: the rest (queue, partners, "
        "rests).",
    )
    steps = Metric("peerd_timed_steps_total", "counter", "The steps those seconds are of.")
    for kind, times in server.batcher.times.items():
        seconds.add(times.wait_s, part="wait", **{"class": kind})
        seconds.add(times.forward_s, part="forward", **{"class": kind})
        steps.add(times.steps, **{"class": kind})
    return [seconds, steps]


def _reservation(server: BlockServer) -> list[Metric]:
    """How much the takers' turns were held back for active contributors."""
    rests = Metric(
        "peerd_priority_taker_rests_total",
        "counter",
        "Rests this server imposed after a turn of takers' work alone while a contributor was "
        "active here (peerd.server.priority.Reservation; never with --priority fifo).",
    )
    rested = Metric(
        "peerd_priority_taker_rest_seconds_total",
        "counter",
        "Their length in seconds: time in which no further turn of takers' work alone started.",
    )
    lane = Metric(
        "peerd_priority_lane_turns_total",
        "counter",
        "Turns of takers' work alone run in the lowest-priority lane while a contributor was "
        "active here, off the compute queue (peerd.server.lane; CPU servers on Linux).",
    )
    reservation = server.batcher.reservation
    if reservation is not None:
        rests.add(reservation.rests)
        rested.add(reservation.rested_s)
    lane.add(server.batcher.lane.jobs_done if server.batcher.lane is not None else 0)
    return [rests, rested, lane]


def _identity(daemon: Daemon) -> Metric:
    node = daemon.node
    return Metric("peerd_info", "gauge", "This daemon; the labels say which.").add(
        1,
        version=daemon_version(),
        model=daemon.model,
        peer_id=node.peer_id.to_string() if node is not None else "",
    )


def _sessions(server: BlockServer | None) -> list[Metric]:
    """What the block server ran for its clients."""
    counters = server.counters if server is not None else None
    return [
        Metric("peerd_sessions_open", "gauge", "Inference sessions open on this server.").add(
            server.open_sessions if server is not None else 0
        ),
        Metric(
            "peerd_sessions_opened_total", "counter", "Inference sessions this server opened."
        ).add(counters.sessions_opened if counters else 0),
        Metric(
            "peerd_sessions_refused_total", "counter", "Sessions refused for lack of cache."
        ).add(counters.sessions_refused if counters else 0),
        Metric("peerd_steps_total", "counter", "Inference steps this server ran.").add(
            counters.steps if counters else 0
        ),
        Metric(
            "peerd_forwards_total",
            "counter",
            "Forwards this server ran over its blocks (a merged one counts once).",
        ).add(server.batcher.counters.forwards if server is not None else 0),
        Metric(
            "peerd_merged_steps_total",
            "counter",
            "Steps that ran in one forward with other sessions' steps (batching).",
        ).add(server.batcher.counters.merged_steps if server is not None else 0),
    ]


def _load(server: BlockServer | None, rate: TokenRate) -> list[Metric]:
    """Tokens through the server's blocks, its announced speed, and its KV cache."""
    cache = server.cache if server is not None else None
    return [
        Metric(
            "peerd_tokens_served_total",
            "counter",
            "Tokens (batch x positions) that went through this server's blocks.",
        ).add(server.counters.tokens_processed if server is not None else 0),
        Metric(
            "peerd_tokens_per_second",
            "gauge",
            f"Tokens through this server's blocks per second, over the last {RATE_WINDOW_S:g} s.",
        ).add(rate.rate()),
        Metric(
            "peerd_throughput_tokens_per_second",
            "gauge",
            "Decode throughput this server announces to the swarm.",
        ).add(server.throughput if server is not None else 0),
        Metric("peerd_cache_tokens_used", "gauge", "KV cache tokens held by open sessions.").add(
            cache.used_tokens if cache is not None else 0
        ),
        Metric("peerd_cache_tokens_free", "gauge", "KV cache tokens free for new sessions.").add(
            cache.free_tokens if cache is not None else 0
        ),
    ]


def _node(daemon: Daemon) -> list[Metric]:
    """The compute queue, the libp2p host's peers and the swarm as this daemon sees it."""
    node = daemon.node
    return [
        Metric(
            "peerd_compute_queue_depth", "gauge", "Compute jobs running or waiting for the device."
        ).add(daemon.compute.depth),
        Metric("peerd_peers_connected", "gauge", "libp2p peers with an open connection.").add(
            len(node.host.get_connected_peers()) if node is not None else 0
        ),
        Metric("peerd_peers_known", "gauge", "libp2p peers with addresses in the peerstore.").add(
            len(node.host.get_peerstore().peers_with_addrs()) if node is not None else 0
        ),
        Metric("peerd_swarm_servers", "gauge", "Servers of the model in this daemon's view.").add(
            len(daemon.swarm.records) if daemon.swarm is not None else 0
        ),
        Metric("peerd_relayed_connections", "gauge", "Peers reached only through a relay.").add(
            _relayed_peers(daemon)
        ),
    ]


def _local_api(api: LocalApi | None) -> list[Metric]:
    return [
        Metric(
            "peerd_generations_total", "counter", "Generations the local API served (Generate)."
        ).add(api.generations if api is not None else 0),
        Metric("peerd_api_connections", "gauge", "Local programs connected to the socket.").add(
            api.connections if api is not None else 0
        ),
    ]


def _state(server: BlockServer) -> Metric:
    state = Metric("peerd_server_state", "gauge", "1 for the server's current state.")
    for name in ("joining", "online", "draining"):
        state.add(1 if server.state.value == name else 0, state=name)
    return state


def _errors(server: BlockServer | None) -> Metric:
    errors = Metric("peerd_errors_total", "counter", "Requests this server refused, by code.")
    for code, count in sorted((server.counters.errors if server is not None else {}).items()):
        errors.add(count, code=code)
    return errors


def daemon_version() -> str:
    from peerd import __version__

    return __version__


async def sample_tokens(daemon: Daemon, rate: TokenRate) -> None:
    """Feed `rate` with the served-token counter once a second, forever."""
    while True:
        server = daemon.server
        rate.record(trio.current_time(), server.counters.tokens_processed if server else 0)
        await trio.sleep(1.0)


async def serve_metrics(
    port: int,
    collect: Callable[[], list[Metric]],
    host: str = "127.0.0.1",
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer GET /metrics on host:port until cancelled; task_status gets the bound port."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    task_status.started(bound)

    async def handle(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await _answer(stream, collect)

    await trio.serve_listeners(handle, listeners)


async def _answer(stream: trio.SocketStream, collect: Callable[[], list[Metric]]) -> None:
    request = b""
    with trio.move_on_after(REQUEST_TIMEOUT_S):
        while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
            data = await stream.receive_some(4096)
            if not data:
                break
            request += data
    parts = request.split(b"\r\n", 1)[0].split()
    if len(parts) < 2:
        status, body, kind = "400 Bad Request", "send GET /metrics\n", "text/plain"
    elif parts[0] not in (b"GET", b"HEAD"):
        status, body, kind = "405 Method Not Allowed", "only GET /metrics\n", "text/plain"
    elif parts[1].split(b"?")[0] != b"/metrics":
        status, body, kind = "404 Not Found", "metrics are at /metrics\n", "text/plain"
    else:
        status, body, kind = "200 OK", render(collect()), CONTENT_TYPE
    payload = body.encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    await stream.send_all(head if parts[:1] == [b"HEAD"] else head + payload)
    await stream.aclose()


def _relayed_peers(daemon: Any) -> int:
    node = daemon.node
    if node is None:
        return 0
    return sum(node.connection_kind(p) == "relayed" for p in node.host.get_connected_peers())
