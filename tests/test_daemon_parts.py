"""Fast tests of the daemon's own pieces: identity, compute queue, flag parsing, DHT keys, how
many blocks fit a memory budget."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
import trio
from transformers import LlamaConfig, MixtralConfig

import blocks
from peerd.daemon.main import DaemonError, blocks_to_serve, parse_blocks
from peerd.daemon.startup import held_bytes, load_serving_span
from peerd.node.identity import IdentityError, load_or_create_identity, peer_id_of
from peerd.node.p2p import BadMultiaddr, parse_peer_maddr
from peerd.server.compute import PRIORITY_INFERENCE, PRIORITY_TRAINING, ComputeQueue
from peerd.session.dht_keys import block_key
from tests.memnet import save_tiny_llama


def test_identity_persists_with_private_mode(tmp_path: Path) -> None:
    path = tmp_path / "state" / "id.key"
    first = peer_id_of(load_or_create_identity(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert peer_id_of(load_or_create_identity(path)) == first
    other = peer_id_of(load_or_create_identity(tmp_path / "other.key"))
    assert other != first


def test_corrupt_identity_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    path.write_bytes(b"short")
    with pytest.raises(IdentityError, match="remove it"):
        load_or_create_identity(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("auto", ("auto", None, None)), ("10", ("count", 10, None)), ("3:7", ("span", 3, 7))],
)
def test_parse_blocks(text: str, expected: tuple[str, int | None, int | None]) -> None:
    assert parse_blocks(text, 30) == expected


@pytest.mark.parametrize("text", ["0:31", "5:5", "x", "0", "31", "a:b", "-1:3"])
def test_parse_blocks_rejects_with_advice(text: str) -> None:
    with pytest.raises(DaemonError, match="--blocks"):
        parse_blocks(text, 30)


def test_bad_multiaddr_says_what_a_good_one_looks_like() -> None:
    with pytest.raises(BadMultiaddr, match="/p2p/"):
        parse_peer_maddr("/ip4/127.0.0.1/tcp/1")


def test_block_keys_are_distinct_multihashes() -> None:
    keys = {block_key("m", i) for i in range(30)} | {block_key("n", 0)}
    assert len(keys) == 31
    assert all(bytes.fromhex(k)[:2] == b"\x12\x20" and len(bytes.fromhex(k)) == 34 for k in keys)


async def test_compute_queue_runs_one_job_at_a_time_inference_first() -> None:
    queue = ComputeQueue()
    order: list[str] = []
    running = 0
    overlap = False
    lock = threading.Lock()
    gate = threading.Event()

    def job(name: str) -> str:
        nonlocal running, overlap
        with lock:
            running += 1
            overlap |= running > 1
        if name == "first":
            gate.wait(5)
        order.append(name)
        with lock:
            running -= 1
        return name

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run, PRIORITY_TRAINING, job, "first")
        await trio.sleep(0.05)
        nursery.start_soon(queue.run, PRIORITY_TRAINING, job, "train")
        await trio.sleep(0.05)
        nursery.start_soon(queue.run, PRIORITY_INFERENCE, job, "infer")
        await trio.sleep(0.05)
        gate.set()
    assert order == ["first", "infer", "train"]
    assert not overlap
    assert queue.depth == 0 and queue.jobs_done == 3


async def test_compute_queue_survives_a_cancelled_waiter() -> None:
    queue = ComputeQueue()
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run, PRIORITY_INFERENCE, gate.wait, 5)
        await trio.sleep(0.05)
        with trio.move_on_after(0.05):
            await queue.run(PRIORITY_INFERENCE, lambda: None)
        gate.set()
    assert await queue.run(PRIORITY_INFERENCE, lambda: 7) == 7


TINY = {"vocab_size": 96, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_blocks_that_fit_a_budget_count_every_expert_of_a_mixtral_block() -> None:
    """Four experts of 3 x 32 x 48 fp32 weights each: the experts alone take 72 KiB a block, 2.4x
    what a dense gated MLP of the same sizes would, so a budget of two blocks' experts plus cache
    fits one block (a dense formula would have fit all four)."""
    config = MixtralConfig(**TINY, num_hidden_layers=4, intermediate_size=48, num_local_experts=4)
    experts = 4 * 3 * 32 * 48 * 4
    cache_tokens = 16
    cache = 4 * 2 * 2 * 8 * cache_tokens  # fp32 keys and values, 2 KV heads of 8
    assert blocks_to_serve(config, 2 * (experts + cache), cache_tokens) == 1
    assert blocks_to_serve(config, 10**9, cache_tokens) == 4  # capped at the model's blocks
    with pytest.raises(DaemonError, match="--memory-budget"):
        blocks_to_serve(config, experts, cache_tokens)


def test_blocks_that_fit_a_budget_of_a_dense_model() -> None:
    config = LlamaConfig(**TINY, num_hidden_layers=6, intermediate_size=64)
    # q, o (32 x 32), k, v (32 x 16), gate, up, down (32 x 64), two norms of 32; fp32
    block = 4 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32)
    cache = 4 * 2 * 2 * 8 * 100
    assert blocks_to_serve(config, 3 * (block + cache), 100) == 3
    assert blocks_to_serve(config, 3 * (block + cache) - 1, 100) == 2


@pytest.mark.parametrize("budget", [None, 10**9, 1])
async def test_a_servers_packed_copies_get_what_its_budget_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int | None
) -> None:
    """`--compile` hands the span's tuning the bytes the memory budget leaves beside its weights
    and a cache of --cache-tokens (None without a budget); the packed copies must fit them."""
    rooms: list[int | None] = []
    monkeypatch.setattr(blocks.Span, "compile_passes", lambda span, room=None: rooms.append(room))
    checkpoint = save_tiny_llama(tmp_path)
    span = await load_serving_span(checkpoint, (0, 4), blocks.Serving(), [], True, budget, 100)
    cache = blocks.cache_bytes_per_block(span.config, span.dtype, 100)
    assert held_bytes(span, 100) == span.weight_bytes + 4 * cache
    assert rooms == [None if budget is None else budget - held_bytes(span, 100)]
    await load_serving_span(checkpoint, (0, 4), blocks.Serving(), [], False, budget, 100)
    assert len(rooms) == 1  # no --compile: no tuning, no copies
