"""Fixtures shared by the multi-process tests: one three-daemon swarm of the default model for
the whole session (starting one costs ~15 s of a 2-core CI machine), and the whole model loaded
by plain transformers as the reference every distributed result must equal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import blocks
from peerd.devtools import localswarm
from peerd.devtools.localswarm import LocalSwarm


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tests' own torch work on one thread, as LocalSwarm gives each daemon: on a 2-core
    machine that also runs daemons, torch's default threads contend (tiny-model greedy decoding
    took 3.7 s instead of 0.13 s on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def daemons_from_a_fork_server() -> Iterator[None]:
    """Daemons the tests start are forks of one process that imported them (~10 s less each on
    a slow 2-core machine; peerd.devtools.forkserver); started with the first daemon."""
    localswarm.use_fork_server()
    yield
    localswarm.use_fork_server(False)


@pytest.fixture(scope="module")
def swarm() -> Iterator[LocalSwarm]:
    """Daemons a, b, c serving 0:10, 10:20, 20:30. Tests must not stop or restart them (a test
    that needs to kill servers starts its own LocalSwarm). One swarm per module, not per
    session: the modules that use it lie far apart in the run, and three idle daemons refreshing
    every 2 s take half a core of CI's two from every test in between (a fresh swarm costs ~6 s
    to start)."""
    yield from three_servers_of_ten()


def three_servers_of_ten() -> Iterator[LocalSwarm]:
    """A fresh LocalSwarm of daemons a, b, c on 0:10, 10:20, 20:30, stopped afterwards."""
    local = LocalSwarm()
    try:
        local.start("a", "0:10")
        local.start("b", "10:20")
        local.start("c", "20:30")
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def local_model() -> Any:
    """The whole default model in this process, as plain transformers loads it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        blocks.resolve_checkpoint("default"), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(blocks.resolve_checkpoint("default"))


def greedy_continuation(model: Any, tokenizer: Any, prompt: str, new_tokens: int) -> list[int]:
    """Token ids transformers' greedy generate adds after `prompt`."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return [int(t) for t in out[0, ids.shape[1] :]]
