"""Where a decode token's time goes, across processes (docs/swarm.md, "Where a token's time goes").

A sampling profile says where each process spends its time, not where a token waits. This puts time
stamps on a token's path in every process at once: with `PEERD_TIMELINE=DIR` in its environment,
`python -m cli` (how a LocalSwarm starts its daemons) calls `install(DIR)`, and so may the client's
own process (a bench, a probe). Each event is a line appended to DIR/PID.log: `perf_counter()` (the
system's monotonic clock, the same in every process of the machine), the pid, the event
(`send0`/`send1` around `MessageStream.send`, `recv` as `receive` returns, `fw0`/`fw1` around a
span's forward, `head0`/`head1` around the client's LM head and sampling), the message type and its
step id.

`python -m peerd.devtools.timeline DIR` follows each decode step of one generation at a time
from the client's send through every server to the client's next send, and prints the median of
each stage. A development tool: each event costs a file write, so its timings run a little slow.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "PEERD_TIMELINE"


class _Log:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._file: Any = None
        self._pid = 0

    def __call__(self, event: str, kind: str = "-", step: object = "-") -> None:
        if self._pid != os.getpid():  # a fork writes a file of its own
            self._pid = os.getpid()
            self._file = open(self.directory / f"{self._pid}.log", "a", buffering=1)  # noqa: SIM115
        self._file.write(f"{time.perf_counter():.6f} {self._pid} {event} {kind} {step}\n")


_originals: list[tuple[type, str, Any]] = []  # what install replaced, for uninstall


def install(directory: Path) -> None:
    """Time-stamp this process's messages, forwards and LM-head passes into `directory`."""
    if _originals:  # installed already
        return
    from blocks.span import Span
    from peerd.node.streams import MessageStream
    from peerd.session.generation import Generator

    directory.mkdir(parents=True, exist_ok=True)
    log = _Log(directory)
    send, receive = MessageStream.send, MessageStream.receive

    @functools.wraps(send)
    async def timed_send(self: MessageStream, message: Any, *args: Any, **kwargs: Any) -> None:
        kind, step = type(message).__name__, getattr(message, "step_id", "-")
        log("send0", kind, step)
        await send(self, message, *args, **kwargs)
        log("send1", kind, step)

    @functools.wraps(receive)
    async def timed_receive(self: MessageStream, *args: Any, **kwargs: Any) -> Any:
        message = await receive(self, *args, **kwargs)
        log("recv", type(message).__name__, getattr(message, "step_id", "-"))
        return message

    for owner, name, timed in [
        (MessageStream, "send", timed_send),
        (MessageStream, "receive", timed_receive),
        (Span, "forward", _around(Span.forward, log, "fw")),
        (Span, "forward_batch", _around(Span.forward_batch, log, "fw")),
        (Generator, "_sample_rows", _around(Generator._sample_rows, log, "head")),
    ]:
        _originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, timed)


def uninstall() -> None:
    """Undo `install` (the tests')."""
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)


def _around(fn: Callable[..., Any], log: _Log, name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        log(f"{name}0")
        try:
            return fn(*args, **kwargs)
        finally:
            log(f"{name}1")

    return timed


def install_from_env() -> None:
    """`install` into $PEERD_TIMELINE when it is set."""
    directory = os.environ.get(ENV)
    if directory:
        install(Path(directory))


# --- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    t: float
    pid: int
    name: str
    kind: str
    step: str


def read(directory: Path) -> list[Event]:
    """Every event of every process in `directory`, in time order."""
    events = []
    for path in directory.glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                events.append(Event(float(parts[0]), int(parts[1]), *parts[2:]))
    return sorted(events, key=lambda e: e.t)


def stages(events: Iterable[Event]) -> dict[str, list[float]]:
    """Seconds spent in each stage of every decode step followed whole: the client is the
    process that sends steps and receives none, the servers are taken in the order the step
    reached them. Stages: `to hop i` (from the previous write's end to the server's read),
    `queue hop i` (read to forward), `forward hop i`, `back` (the last forward's end to the
    client's read of the last reply), `client` (that read to the next step's send: the LM
    head, sampling, the embedding)."""
    events = list(events)
    receivers = {e.pid for e in events if e.name == "recv" and e.kind == "Step"}
    senders = {e.pid for e in events if e.name == "send0" and e.kind == "Step"} - receivers
    if len(senders) != 1:
        raise ValueError(f"expected one client process (sends steps, receives none): {senders}")
    (client,) = senders
    sends = [e for e in events if e.pid == client and e.name == "send0" and e.kind == "Step"]
    out: dict[str, list[float]] = {}
    for this, after in itertools.pairwise(sends):
        window = [e for e in events if this.t <= e.t < after.t]
        row = _follow(window, client, this.step)
        if row is not None:
            row["client"] = after.t - row.pop("_last_reply")
            for name, seconds in row.items():
                out.setdefault(name, []).append(seconds)
    return out


def _follow(window: list[Event], client: int, step: str) -> dict[str, float] | None:
    """One step's stages within `window` (from its send to the next), None if incomplete."""
    written = next((e.t for e in window if e.pid == client and e.name == "send1"), None)
    if written is None:
        return None
    row: dict[str, float] = {}
    hops = [e for e in window if e.name == "recv" and e.kind == "Step" and e.step == step]
    for i, arrived in enumerate(hops, 1):
        mine = [e for e in window if e.pid == arrived.pid and e.t >= arrived.t]
        started = next((e for e in mine if e.name == "fw0"), None)
        if started is None:
            return None
        ended = next((e for e in mine if e.name == "fw1" and e.t >= started.t), None)
        if ended is None:
            return None
        row[f"to hop {i}"] = arrived.t - written
        row[f"queue hop {i}"] = started.t - arrived.t
        row[f"forward hop {i}"] = ended.t - started.t
        written = ended.t
    replies = [e for e in window if e.pid == client and e.name == "recv" and e.kind == "StepResult"]
    if not hops or not replies:
        return None
    row["back"] = replies[-1].t - written
    row["_last_reply"] = replies[-1].t
    return row


def summary(directory: Path) -> str:
    rows = stages(read(directory))
    if not rows:
        return f"no whole decode step in {directory}"
    lines = [f"{'stage':16s} {'median ms':>10s} {'steps':>6s}"]
    for name, values in rows.items():
        lines.append(f"{name:16s} {statistics.median(values) * 1e3:10.2f} {len(values):6d}")
    total = sum(statistics.median(v) for v in rows.values())
    lines.append(f"{'sum of medians':16s} {total * 1e3:10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the processes wrote (PEERD_TIMELINE)")
    print(summary(parser.parse_args(argv).directory))


if __name__ == "__main__":
    main()
