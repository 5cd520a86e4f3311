"""What `peerd generate`, `peerd chat` and `peerd status` do at a terminal, on top of the client
library (peerd.client) talking to the local daemon."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

import wire
from peerd.client import Client, GenerateOptions

HELP = "commands: /reset (new conversation), /route (servers in use), /quit; Ctrl-C stops an answer"
CHAT_MAX_LENGTH = 4096


def stream_answer(
    client: Client, prompt: str, out: TextIO, *, chat: bool, session: str | None, **options: Any
) -> tuple[int, float, str]:
    """Print the answer as it streams; return (tokens, seconds, reason). Ctrl-C stops it."""
    started = time.perf_counter()
    tokens = 0
    reason = "cancelled"
    messages = client.stream_tokens(prompt, chat=chat, session=session, **options)
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
    session = client.open_session(CHAT_MAX_LENGTH)
    route = client.last_route
    out.write(f"peerd chat with {client.welcome.model} through {len(route)} servers. {HELP}\n")
    out.flush()
    source = iter(lines) if lines is not None else None
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
        if text == "/quit":
            break
        if text == "/reset":
            client.close_session(session)
            session = client.open_session(CHAT_MAX_LENGTH)
            route = client.last_route
            out.write("(new conversation)\n")
            continue
        if text == "/route":
            out.write("route: " + " -> ".join(route) + "\n")
            continue
        if text.startswith("/"):
            out.write(f"unknown command {text}; {HELP}\n")
            continue
        tokens, seconds, reason = stream_answer(
            client, text, out, chat=True, session=session, **vars(options)
        )
        stopped = " (stopped)" if reason == "cancelled" else ""
        out.write(f"[{tokens} tokens, {tokens / max(seconds, 1e-9):.1f} tokens/s{stopped}]\n")
        out.flush()
    client.close_session(session)


def format_status(status: wire.StatusResponse) -> str:
    """Coverage per block and one line per server, as a plain table."""
    lines = [f"peer {status.peer_id} (peerd {status.version}, up {status.uptime_s:.0f} s)"]
    if status.serving is not None:
        s = status.serving
        lines.append(
            f"serving blocks {s.start}:{s.end} of {s.model} ({s.state}), "
            f"{status.steps_served} steps, {status.tokens_served} tokens served"
        )
    if not status.swarm:
        lines.append("no servers known yet")
        return "\n".join(lines)
    model = status.swarm[0].model
    num_blocks = max(info.end for info in status.swarm)
    counts = [0] * num_blocks
    for info in status.swarm:
        if info.state == "online":
            for block in range(info.start, info.end):
                counts[block] += 1
    holes = [str(b) for b, n in enumerate(counts) if n == 0]
    lines.append(
        f"{model}: {num_blocks} blocks seen, servers per block "
        + " ".join(str(n) for n in counts)
        + (f"; NOT SERVED: {', '.join(holes)}" if holes else "; every block is served")
    )
    header = (
        f"{'peer':<20} {'span':>7} {'state':<8} {'tok/s':>7} {'rtt ms':>7} {'link':<8} free cache"
    )
    lines += ["", header]
    rtts = list(status.rtts) + [-1.0] * (len(status.swarm) - len(status.rtts))
    for info, rtt in sorted(zip(status.swarm, rtts, strict=True), key=lambda x: x[0].start):
        link = "relayed" if info.relayed else "direct"
        shown_rtt = f"{rtt * 1000:.1f}" if rtt >= 0 else "-"
        lines.append(
            f"...{info.peer_id[-16:]:<17} {info.start:>3}:{info.end:<3} {info.state:<8} "
            f"{info.throughput:>7.1f} {shown_rtt:>7} {link:<8} {info.free_cache_tokens}"
        )
    return "\n".join(lines)
