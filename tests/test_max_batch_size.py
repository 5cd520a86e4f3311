"""peerd start --max-batch-size N: the most rows one merged forward of several sessions' steps
takes on a server, from the flag through the daemon config to the server's StepBatcher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from typer.testing import CliRunner

import blocks
from cli import app
from peerd.daemon.main import DaemonConfig
from peerd.server.batching import MAX_BATCH_ROWS
from peerd.server.block_server import BlockServer, ServerLimits
from peerd.server.compute import ComputeQueue
from tests.tiny_models import save_tiny

START = ["start", "--new-swarm", "--blocks", "none"]


def started_with(monkeypatch: pytest.MonkeyPatch, *flags: str) -> tuple[Any, list[DaemonConfig]]:
    """`peerd start` run in this process with `flags`, the daemon itself replaced by a stand-in
    that keeps the config it was given."""
    import peerd.daemon.main

    configs: list[DaemonConfig] = []
    monkeypatch.setattr(peerd.daemon.main, "run", configs.append)
    return CliRunner().invoke(app, [*START, *flags]), configs


def test_the_flag_reaches_the_daemon_config(monkeypatch: pytest.MonkeyPatch) -> None:
    result, configs = started_with(monkeypatch, "--max-batch-size", "4")
    assert result.exit_code == 0, result.output
    assert configs[0].limits.max_merged_rows == 4
    result, configs = started_with(monkeypatch)
    assert result.exit_code == 0, result.output
    assert configs[0].limits.max_merged_rows == MAX_BATCH_ROWS == ServerLimits().max_merged_rows


@pytest.mark.parametrize(
    ("value", "why"),
    [("0", "greater than or equal to 1"), ("-3", "greater than or equal to 1"), ("8.5", "integer")],
)
def test_a_bound_under_one_row_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str, why: str
) -> None:
    result, configs = started_with(monkeypatch, "--max-batch-size", value)
    assert result.exit_code == 2 and not configs
    assert "--max-batch-size" in result.output and why in result.output


def test_a_server_refuses_a_bound_under_one_row() -> None:
    with pytest.raises(ValueError, match=r"max_merged_rows 0: give 1 or more"):
        server_with(ServerLimits(max_merged_rows=0))


def server_with(limits: ServerLimits) -> BlockServer:
    return BlockServer(
        model="tiny", start=0, end=3, compute=ComputeQueue(), peer_id="p", addrs=list, limits=limits
    )


@pytest.fixture(scope="module")
def span(tmp_path_factory: pytest.TempPathFactory) -> blocks.Span:
    path: Path = save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")
    return blocks.load_span(path, 0, 3)


@pytest.mark.parametrize("bound", [1, 2, 3])
async def test_a_servers_merged_forwards_take_at_most_its_bound_of_rows(
    span: blocks.Span, bound: int
) -> None:
    """Six clients' decode steps (one row each, two of them two rows) queue together: the
    server's batcher merges them into forwards of at most `bound` rows (a bound of one: none
    merge), and every step gets its output."""
    server = server_with(ServerLimits(max_merged_rows=bound))
    cache = blocks.MemoryCache(budget_tokens=10_000)
    rows_of = [1, 2, 1, 1, 2, 1]
    sessions = [cache.open_session(rows, 16) for rows in rows_of]
    merged: list[int] = []  # rows of each merged forward
    original = span.forward_batch

    def counted(steps: Any, adapter: str | None = None) -> list[torch.Tensor]:
        merged.append(sum(hidden.shape[0] for hidden, _ in steps))
        return original(steps, adapter)

    async def client(i: int) -> None:
        step = torch.randn(rows_of[i], 1, 32)
        out = await server.batcher.run(span, sessions[i], step, owner=f"peer{i}")
        assert out.shape == step.shape

    span.forward_batch = counted  # type: ignore[method-assign]
    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(rows_of)):
                nursery.start_soon(client, i)
    finally:
        del span.forward_batch
    assert server.batcher.max_rows == bound
    assert server.batcher.counters.steps == len(rows_of)
    assert [s.position for s in sessions] == [1] * len(rows_of)
    if bound == 1:
        assert merged == [] and server.batcher.counters.forwards == len(rows_of)
    else:  # the first step may start alone; the others wait and merge up to the bound
        assert merged and max(merged) == bound, merged
