"""Fixtures shared by the multi-process tests: one three-daemon swarm of the default model for
the modules that use it, which run first (starting one costs ~15 s of a 2-core CI machine), and
the whole model loaded by plain transformers as the reference every distributed result must
equal."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import blocks
from peerd.devtools import localswarm
from peerd.devtools.localswarm import LocalSwarm
from tests.memnet import TINY_BLOCKS, save_tiny_llama

# The daemons tests start do not compile their passes (`peerd start --compile`, 10-20 s per
# daemon on a 2-core machine); tests/test_compiled_decode.py covers compiling.
os.environ["PEERD_COMPILE"] = "0"


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


# The shared swarm while it runs (the `swarm` fixture), for pytest_runtest_teardown to stop.
_shared: list[LocalSwarm] = []


@pytest.fixture(scope="session")
def swarm() -> Iterator[LocalSwarm]:
    """Daemons a, b, c serving 0:10, 10:20, 20:30. Tests must not stop or restart them (a test
    that needs to kill servers starts its own LocalSwarm). One swarm for every module that uses
    it: those modules run first and it stops after the last of them (pytest_collection_modifyitems,
    pytest_runtest_teardown), since three idle daemons refreshing every 2 s take half a core of
    CI's two from every test that runs beside them."""
    servers = three_servers_of_ten()
    _shared.append(next(servers))
    try:
        yield _shared[0]
    finally:
        _shared.clear()
        servers.close()  # stops them, if the last user's teardown has not already


def _uses_shared_swarm(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get("swarm", ()) if info is not None else ()
    return bool(defs) and defs[-1].func is swarm.__wrapped__  # type: ignore[attr-defined]


# The modules that use the shared swarm. pytest-xdist's workers (scripts/test.sh runs two) take
# a module whole, and these together (_ModulesWhole): one worker starts the swarm once.
# pytest_collection_modifyitems checks the list against the modules that use the fixture.
SHARED_SWARM_MODULES = frozenset(
    f"tests/test_{name}.py"
    for name in (
        "admission",
        "api",
        "daemon_startup",
        "first_use",
        "model",
        "training",
        "transport_security",
    )
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that use the shared swarm first, each whole and in its own order (splitting a
    module would set its module fixtures up twice), then the rest as collected."""
    using = {getattr(item, "module", None) for item in items if _uses_shared_swarm(item)}
    unlisted = {i.nodeid.split("::")[0] for i in items if getattr(i, "module", None) in using}
    if unlisted := unlisted - SHARED_SWARM_MODULES:
        raise pytest.UsageError(f"conftest.py: add {sorted(unlisted)} to SHARED_SWARM_MODULES")
    first = [item for item in items if getattr(item, "module", None) in using]
    items[:] = first + [item for item in items if getattr(item, "module", None) not in using]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadfile`: every module whole on one worker, and the modules of the shared
    swarm together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _ModulesWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "shared swarm" if module in SHARED_SWARM_MODULES else module

    return _ModulesWhole(config, log)


@pytest.hookimpl(trylast=True)  # after the item's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared swarm once the last module that uses it is done."""
    module = getattr(item, "module", None)
    leaving = nextitem is None or getattr(nextitem, "module", None) is not module
    if _shared and leaving and not any(map(_uses_shared_swarm, _later(item, nextitem))):
        _shared[0].stop()


def _later(item: pytest.Item, nextitem: pytest.Item | None) -> list[pytest.Item]:
    """The items after `item` in this run."""
    if nextitem is None:
        return []
    items = item.session.items
    return items[items.index(nextitem) :]


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


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama checkpoint (tests/memnet.py), one per module that asks for it: a
    module may add files to it (a tokenizer) without the others seeing them."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def whole(tiny_llama: Path) -> blocks.Span:
    """Every block of the tiny llama in one span: the reference a route of servers must match."""
    return blocks.load_span(tiny_llama, 0, TINY_BLOCKS)
