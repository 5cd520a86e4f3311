"""peerd.devtools.timeline: the time stamps it writes, and the stages it reads back from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

import blocks
import wire
from blocks import MemoryCache
from peerd.devtools import timeline
from peerd.node.streams import MessageStream
from tests.memnet import stream_pair
from tests.tiny_models import save_tiny


def _write(directory: Path, pid: int, lines: list[tuple[float, str, str, int | str]]) -> None:
    text = "".join(f"{t:.6f} {pid} {event} {kind} {step}\n" for t, event, kind, step in lines)
    with open(directory / f"{pid}.log", "a") as f:
        f.write(text)


def _step(directory: Path, at: float, step: int) -> None:
    """One step of a client (pid 10) through two servers (20, 30) that pushes, from `at`."""
    ms = 1e-3
    _write(directory, 10, [(at, "send0", "Step", step), (at + 1 * ms, "send1", "Step", step)])
    _write(directory, 20, [
        (at + 2 * ms, "recv", "Step", step), (at + 2.5 * ms, "fw0", "-", "-"),
        (at + 12.5 * ms, "fw1", "-", "-"), (at + 13 * ms, "send0", "Step", step),
    ])  # fmt: skip
    _write(directory, 30, [
        (at + 15 * ms, "recv", "Step", step), (at + 15.3 * ms, "fw0", "-", "-"),
        (at + 25.3 * ms, "fw1", "-", "-"),
    ])  # fmt: skip
    _write(directory, 10, [
        (at + 14 * ms, "recv", "StepResult", step), (at + 27 * ms, "recv", "StepResult", step),
        (at + 27.2 * ms, "head0", "-", "-"), (at + 31 * ms, "head1", "-", "-"),
    ])  # fmt: skip


def test_stages_follow_each_step_from_the_client_through_the_servers_and_back(
    tmp_path: Path,
) -> None:
    for i in range(4):
        _step(tmp_path, 0.032 * i, i)
    rows = timeline.stages(timeline.read(tmp_path))
    want = {
        "to hop 1": 1.0, "queue hop 1": 0.5, "forward hop 1": 10.0,
        "to hop 2": 2.5, "queue hop 2": 0.3, "forward hop 2": 10.0,
        "back": 1.7, "client": 5.0,
    }  # fmt: skip
    assert list(rows) == list(want)
    for name, ms in want.items():
        assert len(rows[name]) == 3  # the last step has no next send to end it
        assert rows[name] == pytest.approx([ms * 1e-3] * 3, abs=1e-6)
    assert "forward hop 2" in timeline.summary(tmp_path)
    _write(tmp_path, 40, [(1.0, "send0", "Step", 9)])  # a second process that only sends
    with pytest.raises(ValueError, match="one client"):
        timeline.stages(timeline.read(tmp_path))


async def test_install_time_stamps_messages_and_forwards_until_uninstalled(
    tmp_path: Path,
) -> None:
    span = blocks.load_span(save_tiny("llama", tmp_path / "llama"), 0, 2)
    original = MessageStream.send
    timeline.install(tmp_path / "tl")
    try:
        ours, theirs = stream_pair("a", "b")
        sender, receiver = MessageStream(ours, 1 << 20), MessageStream(theirs, 1 << 20)
        step = wire.Step(session_id="s", step_id=7, hidden_states=torch.ones(1, 1, 32))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.send, step)
            got = await receiver.receive(10)
        assert isinstance(got, wire.Step)
        with MemoryCache(budget_tokens=64).open_session(1, 8) as session:
            span(torch.randn(1, 1, 32), session)
    finally:
        timeline.uninstall()
    assert MessageStream.send is original
    events = [(e.name, e.kind, e.step) for e in timeline.read(tmp_path / "tl")]
    messages = [e for e in events if e[0] not in ("fw0", "fw1")]
    assert messages[0] == ("send0", "Step", "7")  # then the write's end and the read, any order
    assert sorted(messages[1:]) == [("recv", "Step", "7"), ("send1", "Step", "7")]
    assert ("fw0", "-", "-") in events and ("fw1", "-", "-") in events
