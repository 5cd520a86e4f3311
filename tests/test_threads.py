"""Torch threads per pass (blocks.threads): prompts get the cores, decode steps keep few."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import blocks
from blocks import threads
from blocks.cache import MemoryCache
from blocks.threads import ThreadPolicy
from tests.memnet import TINY_BLOCKS, save_tiny_llama


def test_large_passes_get_prefill_threads_and_small_ones_decode_threads() -> None:
    policy = ThreadPolicy(decode=1, prefill=3, prefill_rows=16)
    assert policy.threads_for(1) == 1
    assert policy.threads_for(8) == 1  # a batch of 8 decode steps is still decode
    assert policy.threads_for(16) == 3
    assert policy.threads_for(84) == 3
    assert ThreadPolicy().threads_for(500) is None  # no policy: torch's own count


def test_the_count_is_set_in_the_thread_that_runs_the_pass() -> None:
    policy = ThreadPolicy(decode=1, prefill=2)
    seen: list[int] = []

    def worker() -> None:
        for rows in (84, 1, 1, 40):
            policy.apply(rows)
            seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [2, 1, 1, 2]


def test_configure_defaults_prefill_to_every_core_and_refuses_nonsense() -> None:
    saved, count = threads.POLICY, torch.get_num_threads()
    try:
        assert threads.configure(1).prefill == threads.available_cores()
        assert torch.get_num_threads() == 1
        assert threads.configure(None).threads_for(1000) is None
        with pytest.raises(ValueError, match="prefill threads must be >= 1"):
            ThreadPolicy(decode=1, prefill=0)
    finally:
        threads.POLICY = saved
        torch.set_num_threads(count)


def test_a_merged_pass_follows_the_policy_too(tmp_path: Path) -> None:
    span = blocks.load_span(save_tiny_llama(tmp_path), 0, TINY_BLOCKS)
    cache = MemoryCache(budget_tokens=1000)
    hidden = span.config.hidden_size
    saved, count = threads.POLICY, torch.get_num_threads()
    seen: list[int] = []

    def worker() -> None:  # a daemon's compute thread
        with cache.open_session(1, 64) as a, cache.open_session(1, 64) as b:
            span.forward(torch.randn(1, 20, hidden), a)  # a prompt: prefill threads
            seen.append(torch.get_num_threads())
            span.forward(torch.randn(1, 20, hidden), b)
            span.forward_batch([(torch.randn(1, 1, hidden), s) for s in (a, b)])  # 2 rows
            seen.append(torch.get_num_threads())

    try:
        threads.POLICY = ThreadPolicy(decode=1, prefill=2, prefill_rows=16)
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    finally:
        threads.POLICY = saved
        torch.set_num_threads(count)
    assert seen == [2, 1]
