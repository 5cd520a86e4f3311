"""What `peerd generate`, `peerd chat` and `peerd status` do at a terminal, on top of the client
library (peerd.sdk.client) talking to the local daemon."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

import wire
from peerd.paths import state_dir
from peerd.sdk.client import Client, DaemonNotRunning, GenerateOptions, PeerdError

HELP = (
    "commands: /reset (new conversation), /route (servers in use), /quit; Ctrl-C stops an "
    "answer; arrow keys and Ctrl-R recall earlier questions"
)
CHAT_MAX_LENGTH = 4096
# Questions `peerd chat` keeps across runs (the up arrow, Ctrl-R), like a shell's history.
HISTORY_LINES = 1000


def chat_history_path() -> Path:
    """Where `peerd chat` keeps its questions: beside the identities, in the user's state dir."""
    return state_dir() / "chat_history"


def line_editing(history: Path) -> Callable[[str], None]:
    """Give input() line editing (GNU readline: arrow keys, Ctrl-R) with the history kept in
    `history` (0600: questions can be private); returns what saves a line to it. Without a
    readline module on this Python, input() stays plain."""
    try:
        import readline
    except ImportError:
        return lambda line: None
    readline.set_history_length(HISTORY_LINES)
    with contextlib.suppress(OSError):
        readline.read_history_file(history)

    def save(line: str) -> None:
        # input() already added the line; written at once, so a killed chat loses nothing.
        with contextlib.suppress(OSError):
            history.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(history, os.O_WRONLY | os.O_CREAT, 0o600))
            readline.write_history_file(history)

    return save


def stream_answer(
    client: Client,
    prompt: str,
    out: TextIO,
    *,
    chat: bool,
    session: str | None,
    options: GenerateOptions | None = None,
    **kwargs: Any,
) -> tuple[int, float, str]:
    """Print the answer as it streams; return (tokens, seconds, reason). Ctrl-C stops it.
    `options` (GenerateOptions) with `kwargs` (its fields) laid over them say how to generate."""
    started = time.perf_counter()
    tokens = 0
    reason = "cancelled"
    messages = client.stream_tokens(prompt, chat=chat, session=session, options=options, **kwargs)
    try:
        for message in messages:
            if isinstance(message, wire.GeneratedToken):
                tokens += 1
                out.write(message.text)
                out.flush()
            else:
                reason = message.reason
    except KeyboardInterrupt:
        messages.close()  # sends Cancel and waits for the daemon to stop
    out.write("\n")
    return tokens, time.perf_counter() - started, reason


def run_chat(
    client: Client,
    options: GenerateOptions,
    lines: Iterable[str] | None = None,
    out: TextIO = sys.stdout,
) -> None:
    """An interactive chat in one inference session: every turn reuses the servers' caches."""
    session = _open_chat(client, options)
    route = client.last_route
    model = options.model or client.welcome.model
    out.write(f"peerd chat with {model} through {len(route)} servers. {HELP}\n")
    out.flush()
    source = iter(lines) if lines is not None else None
    at_terminal = source is None and sys.stdin.isatty()
    remember = line_editing(chat_history_path()) if at_terminal else (lambda line: None)
    while True:
        try:
            if source is not None:
                line = next(source, None)
                if line is None:
                    break
            else:
                line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            break
        text = line.strip()
        if not text:
            continue
        remember(line)
        if text == "/quit":
            break
        if text == "/reset":
            client.close_session(session)
            session = _open_chat(client, options)
            route = client.last_route
            out.write("(new conversation)\n")
            continue
        if text == "/route":
            out.write("route: " + " -> ".join(route) + "\n")
            continue
        if text.startswith("/"):
            out.write(f"unknown command {text}; {HELP}\n")
            continue
        try:
            tokens, seconds, reason = stream_answer(
                client, text, out, chat=True, session=session, options=options
            )
        except KeyboardInterrupt:  # Ctrl-C before the answer began: nothing was asked yet
            out.write("\n")
            tokens, seconds, reason = 0, 0.0, "cancelled"
        stopped = " (stopped)" if reason == "cancelled" else ""
        out.write(f"[{tokens} tokens, {tokens / max(seconds, 1e-9):.1f} tokens/s{stopped}]\n")
        out.flush()
    client.close_session(session)


def _open_chat(client: Client, options: GenerateOptions) -> str:
    return client.open_session(
        CHAT_MAX_LENGTH, active_adapter=options.active_adapter, model=options.model
    )


def servers_per_block(status: wire.StatusResponse) -> list[int]:
    """How many online servers hold each block of the model (of those the daemon has seen, from
    a daemon that does not say how many the model has)."""
    seen = max((info.end for info in status.swarm), default=0)
    counts = [0] * max(status.num_blocks, seen)
    for info in status.swarm:
        if info.state == "online":
            for block in range(info.start, info.end):
                counts[block] += 1
    return counts


def _links(status: wire.StatusResponse) -> list[str]:
    """The connection to each server now (from the daemon), else what its record says; a
    server behind NAT is marked `nat`."""
    now = list(status.links) + [""] * (len(status.swarm) - len(status.links))
    out = []
    for info, link in zip(status.swarm, now, strict=True):
        link = link or ("relayed" if info.relayed else "direct")
        out.append(f"{link} nat" if info.relayed and link != "relayed" else link)
    return out


def format_status(status: wire.StatusResponse) -> str:
    """Coverage per block and one line per server, as a plain table."""
    lines = [
        f"peer {status.peer_id} (peerd {status.version}, up {status.uptime_s:.0f} s, "
        f"reachability {status.reachability})"
    ]
    if status.serving is not None:
        s = status.serving
        lines.append(
            f"serving blocks {s.start}:{s.end} of {s.model} ({s.state}), "
            f"{status.steps_served} steps, {status.tokens_served} tokens served"
        )
        if s.device:
            lines.append(f"on {runs_on(s)}")
        if s.adapters:
            lines.append(f"adapters: {', '.join(s.adapters)}")
        lines.append(f"work given to peers with standing: {status.contributor_share:.0%}")
    lines.append(f"our standing, as the servers we used grant it: {status.standing:.3f}")
    if not status.swarm:
        lines.append("no servers known yet")
        return "\n".join(lines)
    model = status.swarm[0].model
    counts = servers_per_block(status)
    num_blocks = len(counts)
    holes = [str(b) for b, n in enumerate(counts) if n == 0]
    lines.append(
        f"{model}: {num_blocks} blocks, servers per block "
        + " ".join(str(n) for n in counts)
        + (f"; NOT SERVED: {', '.join(holes)}" if holes else "; every block is served")
    )
    header = (
        f"{'peer':<20} {'span':>7} {'state':<8} {'tok/s':>7} {'rtt ms':>7} {'link':<8} "
        f"{'free cache':>10} {'runs on':<20} adapters"
    )
    lines += ["", header]
    rtts = list(status.rtts) + [-1.0] * (len(status.swarm) - len(status.rtts))
    links = _links(status)
    rows = sorted(zip(status.swarm, rtts, links, strict=True), key=lambda x: x[0].start)
    for info, rtt, link in rows:
        shown_rtt = f"{rtt * 1000:.1f}" if rtt >= 0 else "-"
        lines.append(
            f"...{info.peer_id[-16:]:<17} {info.start:>3}:{info.end:<3} {info.state:<8} "
            f"{info.throughput:>7.1f} {shown_rtt:>7} {link:<8} {info.free_cache_tokens:>10} "
            f"{runs_on(info):<20} {','.join(info.adapters) or '-'}"
        )
    return "\n".join(lines + _addresses(status) + models_lines(status))


def models_lines(status: wire.StatusResponse) -> list[str]:
    """The swarm's models (when it serves more than one): each with its servers, its coverage,
    and whether `peerd generate --model NAME` can use it here."""
    served = [m for m in status.models if m.servers]
    if len(served) < 2:
        return []
    lines = ["", "models in the swarm (peerd generate --model NAME):"]
    for m in served:
        if not m.num_blocks:
            coverage = "blocks unknown here"
        elif m.blocks_served == m.num_blocks:
            coverage = f"all {m.num_blocks} blocks served"
        else:
            coverage = f"{m.blocks_served} of {m.num_blocks} blocks served"
        usable = "" if m.checkpoint else "; no checkpoint here (peerd start --client-models DIR)"
        lines.append(f"  {m.name}: {m.servers} servers, {coverage}{usable}")
    return lines


def _addresses(status: wire.StatusResponse) -> list[str]:
    """Where each server, and this daemon, can be dialled (what --initial-peers takes)."""
    lines = ["", "addresses (for --initial-peers):"]
    if status.addrs:
        lines.append(f"  this daemon: {' '.join(status.addrs)}")
    for info in sorted(status.swarm, key=lambda i: i.start):
        if info.peer_id != status.peer_id:
            name = f" ({info.public_name})" if info.public_name else ""
            lines.append(f"  ...{info.peer_id[-16:]}{name}: {' '.join(info.addrs) or '-'}")
    return lines


def runs_on(info: wire.ServerInfo) -> str:
    """Device, dtype and quantization of a server, e.g. "cuda:0 bfloat16 nf4" ("-": not said,
    an older server)."""
    quant = f" {info.quant}" if info.quant not in ("", "none") else ""
    return f"{info.device} {info.dtype}{quant}" if info.device else "-"


def status_table(status: wire.StatusResponse) -> Any:
    """The same facts as format_status, as a rich renderable for a terminal: a coverage line
    with unserved blocks in red, and one table row per server."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(f"peer {status.peer_id} (peerd {status.version}, up {status.uptime_s:.0f} s)")
    parts: list[Any] = [head]
    if status.serving is not None:
        s = status.serving
        parts.append(
            Text(
                f"serving blocks {s.start}:{s.end} of {s.model} ({s.state}), "
                f"{status.steps_served} steps, {status.tokens_served} tokens served"
            )
        )
        if s.adapters:
            parts.append(Text(f"adapters: {', '.join(s.adapters)}"))
        parts.append(Text(f"work given to peers with standing: {status.contributor_share:.0%}"))
    parts.append(Text(f"our standing, as the servers we used grant it: {status.standing:.3f}"))
    if not status.swarm:
        parts.append(Text("no servers known yet", style="yellow"))
        return Group(*parts)
    counts = servers_per_block(status)
    coverage = Text(f"{status.swarm[0].model}: servers per block ")
    for n in counts:
        coverage.append(str(min(n, 9)), style="bold red" if n == 0 else "green")
    holes = [str(b) for b, n in enumerate(counts) if n == 0]
    coverage.append(
        f"  NOT SERVED: {', '.join(holes)}" if holes else "  every block is served",
        style="bold red" if holes else "green",
    )
    parts.append(coverage)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name, justify in [("peer", "left"), ("span", "right"), ("state", "left"),
                          ("tok/s", "right"), ("rtt ms", "right"), ("link", "left"),
                          ("free cache", "right"), ("runs on", "left"),
                          ("adapters", "left")]:  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    rtts = list(status.rtts) + [-1.0] * (len(status.swarm) - len(status.rtts))
    state_style = {"online": "green", "joining": "yellow", "draining": "magenta"}
    rows = sorted(zip(status.swarm, rtts, _links(status), strict=True), key=lambda x: x[0].start)
    for info, rtt, link in rows:
        table.add_row(
            f"...{info.peer_id[-16:]}",
            f"{info.start}:{info.end}",
            Text(info.state, style=state_style.get(info.state, "")),
            f"{info.throughput:.1f}",
            f"{rtt * 1000:.1f}" if rtt >= 0 else "-",
            link,
            str(info.free_cache_tokens),
            runs_on(info),
            ", ".join(info.adapters) or "-",
        )
    lines = _addresses(status) + models_lines(status)
    parts += [Text(""), table, *(Text(line) for line in lines)]
    return Group(*parts)


class _StatusPoller:
    """Asks the daemon for its status, reconnecting after the daemon went away: a failure is
    returned (to be shown) rather than raised."""

    def __init__(self, connect: Callable[[], Client]) -> None:
        self._connect = connect
        self._client: Client | None = None

    def current(self) -> wire.StatusResponse | Exception:
        try:
            if self._client is None:
                self._client = self._connect()
            return self._client.status()
        except (DaemonNotRunning, PeerdError, OSError) as e:
            self.close()
            return e

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _shown(reply: wire.StatusResponse | Exception, interval: float, live: bool) -> Any:
    """One refresh as a terminal shows it: a rich renderable when live, else plain text."""
    from rich.text import Text

    stamp = time.strftime("%H:%M:%S")
    if isinstance(reply, Exception):
        return Text(f"{stamp}  {reply} (asking again in {interval:g} s)", style="yellow")
    return status_table(reply) if live else f"{stamp}\n{format_status(reply)}\n"


def watch_status(
    connect: Callable[[], Client],
    interval: float,
    out: TextIO,
    *,
    count: int | None = None,
    live: bool | None = None,
) -> None:
    """Show the daemon's status every `interval` seconds (`count` times, else until Ctrl-C): in
    place on a terminal, as successive plain tables otherwise. A daemon that is not (yet)
    running is shown as such and asked again at the next refresh."""
    from rich.console import Console
    from rich.live import Live

    console = Console(file=out)
    live = console.is_terminal if live is None else live
    poller = _StatusPoller(connect)
    shown = 0
    try:
        if live:
            first = _shown(poller.current(), interval, live)
            with Live(first, console=console, auto_refresh=False) as view:
                shown = 1
                while count is None or shown < count:
                    time.sleep(interval)
                    view.update(_shown(poller.current(), interval, live), refresh=True)
                    shown += 1
        else:
            while count is None or shown < count:
                if shown:
                    time.sleep(interval)
                reply = _shown(poller.current(), interval, live)
                out.write(reply if isinstance(reply, str) else f"{reply}\n")
                out.flush()
                shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        poller.close()
