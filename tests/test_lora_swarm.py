"""LoRA through a swarm of real daemons: a PEFT adapter made here, served by two of three daemons
of a tiny random llama, must give the greedy tokens the local PEFT model gives, and no route of an
adapter request may touch the daemon that lacks it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from libp2p.peer.id import ID
from transformers import AutoModelForCausalLM, AutoTokenizer

import blocks
import wire
from peerd.devtools.localswarm import ROOT, LocalSwarm
from peerd.node.p2p import INFERENCE_PROTOCOL
from peerd.node.streams import MessageStream
from peerd.sdk.client import Client, PeerdError
from peerd.session.leech import open_leech
from tests.tiny_models import llama_for_tokenizer

peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ADAPTER = "shout"
NEW_TOKENS = 12
PROMPT = [1, 520, 3400, 28, 253, 1234, 77]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny llama checkpoint (with the default model's tokenizer, so the daemons can decode),
    a PEFT LoRA adapter on it with non-zero B matrices, and both models in this process."""
    root = tmp_path_factory.mktemp("lora-swarm")
    tokenizer = AutoTokenizer.from_pretrained(blocks.resolve_checkpoint("default"))
    config = llama_for_tokenizer(
        tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=6, initializer_range=0.3
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    base.save_pretrained(root / "tiny-llama")
    tokenizer.save_pretrained(root / "tiny-llama")
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(1)
    model = peft.get_peft_model(base, lora).eval()
    model.save_pretrained(root / ADAPTER)
    eos = tokenizer.eos_token_id
    want = {adapter: local_greedy(model, PROMPT, eos, adapter) for adapter in (True, False)}
    return {"checkpoint": root / "tiny-llama", "adapter": root / ADAPTER, "want": want}


@pytest.fixture(scope="module")
def swarm(made: dict[str, Any]) -> Iterator[LocalSwarm]:
    """a 0:3 and b 3:6 have the adapter; c holds all six blocks without it and claims to be so
    fast that every plain route goes through c alone."""
    model = ["--model", str(made["checkpoint"])]
    adapter = ["--adapters", str(made["adapter"])]
    local = LocalSwarm()
    try:
        local.start("a", "0:3", *model, *adapter)
        local.start("b", "3:6", *model, *adapter)
        local.start("c", "0:6", *model, "--throughput", "1000")
        with Client(local.daemons[2].socket) as client:
            deadline = time.monotonic() + 60
            while len([s for s in client.status().swarm if s.state == "online"]) < 3:
                assert time.monotonic() < deadline, "the daemons did not see each other"
                time.sleep(0.5)
        yield local
    finally:
        local.stop()


def local_greedy(model: Any, ids: list[int], eos: int, adapter: bool) -> list[int]:
    """Greedy tokens of the local PEFT model (with or without its adapter), stopping at EOS as
    the daemon does."""
    sequence = torch.tensor([ids])
    new: list[int] = []
    with torch.no_grad(), contextlib.nullcontext() if adapter else model.disable_adapter():
        for _ in range(NEW_TOKENS):
            token = int(model(sequence).logits[0, -1].argmax())
            new.append(token)
            if token == eos:
                break
            sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
    return new


def test_greedy_output_through_the_swarm_equals_local_peft(
    swarm: LocalSwarm, made: dict[str, Any]
) -> None:
    with Client(swarm.daemons[2].socket) as client:
        adapted = client.generate_full(
            input_ids=PROMPT, max_new_tokens=NEW_TOKENS, active_adapter=ADAPTER
        )
        plain = client.generate_full(input_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    want = made["want"][True]
    assert adapted.token_ids == want
    assert plain.token_ids == made["want"][False]
    assert adapted.token_ids != plain.token_ids, "the adapter must change the greedy output"

    # The transformers-compatible model, with the adapter chosen at from_pretrained.
    from peerd.sdk.model import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(
        made["checkpoint"], swarm.daemons[2].socket, active_adapter=ADAPTER
    )
    try:
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)
    finally:
        model.close()
    assert out[0, len(PROMPT) :].tolist() == want[:4]


def test_routes_with_the_adapter_avoid_the_server_without_it(swarm: LocalSwarm) -> None:
    a, b, c = swarm.daemons
    with Client(c.socket) as client:
        status = client.status()
        adapters = {info.peer_id: info.adapters for info in status.swarm}
        assert adapters == {a.peer_id: (ADAPTER,), b.peer_id: (ADAPTER,), c.peer_id: ()}
        for _ in range(3):
            session = client.open_session(32, active_adapter=ADAPTER)
            peers = {hop.split("[")[0] for hop in client.last_route}
            assert peers == {a.peer_id, b.peer_id}, client.last_route
        client.open_session(32)
        assert [hop.split("[")[0] for hop in client.last_route] == [c.peer_id]
        # A session keeps the adapter it was opened with.
        with pytest.raises(PeerdError, match="runs with adapter 'shout', not 'calm'") as e:
            client.generate(input_ids=PROMPT, session=session, active_adapter="calm")
        assert e.value.code == wire.ErrorCode.BAD_REQUEST
    with Client(a.socket) as client:
        assert client.status().serving.adapters == (ADAPTER,)  # type: ignore[union-attr]


async def test_a_hop_without_the_adapter_refuses_with_a_typed_error(
    swarm: LocalSwarm, made: dict[str, Any]
) -> None:
    async with open_leech(str(made["checkpoint"]), swarm.initial_peers) as leech:
        without, with_it = swarm.daemons[2], swarm.daemons[0]
        for daemon, answer in ((without, wire.Error), (with_it, wire.SessionOpened)):
            raw = await leech.node.host.new_stream(
                ID.from_base58(daemon.peer_id), [INFERENCE_PROTOCOL]
            )
            stream = MessageStream(raw, wire.DEFAULT_MAX_FRAME_SIZE)
            await stream.send(
                wire.OpenSession(
                    session_id="s",
                    model=leech.swarm.model,
                    start=0,
                    end=3,
                    max_length=8,
                    active_adapter=ADAPTER,
                )
            )
            reply = await stream.receive(10)
            await stream.close()
            assert isinstance(reply, answer), reply
            if isinstance(reply, wire.Error):
                assert reply.code == wire.ErrorCode.ADAPTER_NOT_FOUND
                assert "no adapter 'shout'" in reply.message


def test_an_unknown_adapter_is_a_clear_error_and_the_daemon_goes_on(swarm: LocalSwarm) -> None:
    with Client(swarm.daemons[2].socket) as client:
        started = time.monotonic()
        with pytest.raises(PeerdError) as e:
            client.generate(input_ids=PROMPT, max_new_tokens=2, active_adapter="whisper")
        assert e.value.code == wire.ErrorCode.ADAPTER_NOT_FOUND
        assert "'whisper'" in str(e.value) and "shout" in str(e.value)
        assert time.monotonic() - started < 15  # refused at once, not after the route wait
        assert len(client.generate_full(input_ids=PROMPT, max_new_tokens=2).token_ids) == 2


def test_status_lists_adapters_and_the_cli_passes_adapter_on(swarm: LocalSwarm) -> None:
    from peerd.sdk.terminal import format_status

    socket = str(swarm.daemons[2].socket)
    with Client(socket) as client:
        table = format_status(client.status())
    assert table.count(ADAPTER) == 2, table  # the rows of a and b
    # One CLI run (each costs seconds of imports): a flag that did not reach the daemon would
    # generate with the base model and exit 0.
    bad = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "Hello", "--adapter", "nope", "--socket", socket],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 1 and "no server of tiny-llama offers adapter 'nope'" in bad.stderr
