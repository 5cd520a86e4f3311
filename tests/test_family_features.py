"""Every capability for every model family (tests/tiny_models.py's TINY_CONFIGS, so a family added
there is covered here at once), through the whole distributed path: AutoDistributedModelForCausalLM
talks to a real LocalApi on a Unix socket, whose sessions and training passes go to three real
BlockServers (a third of the blocks each) on an in-memory network (tests/memnet.py), all in this
process. Each family's tiny random checkpoint is compared with transformers (and PEFT) running the
whole model locally:

- greedy 20 tokens equal transformers' generate (past Mixtral's sliding window of 16);
- a left-padded batch of 3 prompts, row for row, equals each prompt alone (logits and tokens);
- a PEFT LoRA adapter served by the spans gives PEFT's own logits;
- deep prompt tuning: loss and prompt gradients through the servers equal local autograd.

Two of the newer families also run through real daemons (slow, multiprocess, at the end).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from torch import nn
from transformers import AutoModelForCausalLM

import blocks
import wire
from peerd.daemon.local_api import LocalApi
from peerd.devtools.localswarm import LocalSwarm
from peerd.sdk.client import Client
from peerd.sdk.model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from peerd.session.generation import Generator
from peerd.session.swarm import SwarmView
from tests.memnet import open_memnet
from tests.numeric import CHAINED, assert_close_scaled
from tests.tiny_models import TINY_CONFIGS, VOCAB, save_tiny

peft = pytest.importorskip("peft")

NEW_TOKENS = 20
PREFIX = 3  # prompt-tuning prefix length
# Prompt gradients through the servers against local autograd, relative to their norm (fp32, the
# same operations; only the order of sums differs).
GRAD_TOLERANCE = 1e-4
ADAPTER = "family-lora"
SHARD_SIZE = "40KB"  # the tiny models (100-400 kB) in 3 shards or more
START_TIMEOUT_S = 120.0  # the in-process daemon's socket opens (loading spans on a loaded CI box)


def thirds(num_blocks: int) -> list[tuple[int, int]]:
    """Three consecutive spans covering every block (the last ones take any remainder)."""
    cuts = [0, num_blocks // 3, 2 * num_blocks // 3, num_blocks]
    return list(itertools.pairwise(cuts))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformers model's stack of decoder layers, as the family names it."""
    family = blocks.family_of(model.config)
    stack = family.root + family.layer_prefix.split(".")[0]  # "model.layers", "transformer.h"
    layers = model.get_submodule(stack)
    assert isinstance(layers, nn.ModuleList)
    return layers


def lora_targets(model: nn.Module) -> list[str]:
    """Every linear layer inside the decoder blocks, by the name PEFT matches (q_proj,
    query_key_value, qkv_proj...): what an "all-linear" adapter of this family changes."""
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in decoder_layers(model).named_modules()
        if isinstance(module, nn.Linear)
    }
    assert names, f"{type(model).__name__} has no linear layer in its blocks"
    return sorted(names)


class InProcessDaemon:
    """A real LocalApi on a Unix socket, in a trio thread of its own, whose Generator (sessions,
    generation, training) reaches three BlockServers on a memnet: the daemon of `peerd start`
    but for the libp2p network and the DHT."""

    def __init__(self, checkpoint: Path, socket: Path, adapters: list[Path]) -> None:
        self.checkpoint = checkpoint
        self.socket = socket
        self.adapters = adapters
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.scope: trio.CancelScope | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # reported to the test thread, which waits on `ready`
            self.failure = e
            self.ready.set()

    async def _main(self) -> None:
        config = blocks.load_config(self.checkpoint)
        model = blocks.model_name(self.checkpoint)
        num_blocks = int(config.num_hidden_layers)
        async with open_memnet() as net:
            for name, (start, end) in zip("abc", thirds(num_blocks), strict=True):
                span = blocks.load_span(self.checkpoint, start, end, adapters=self.adapters)
                server = net.serve(name, span, model=model)
                server.adapters = span.adapters  # what `peerd start --adapters` puts in a record
            view = SwarmView(net.node("client"), model, num_blocks, refresh_period=60)  # type: ignore[arg-type]
            view.records = net.records()
            view.refresh = _no_dht  # type: ignore[method-assign]  # a memnet has no DHT
            generator = Generator(blocks.load_client_side(self.checkpoint), view)

            async def get_generator() -> Generator:
                return generator

            welcome = wire.Welcome(
                version="0",
                peer_id="in-process",
                model=model,
                num_blocks=num_blocks,
                hidden_size=int(config.hidden_size),
            )
            api = LocalApi(
                socket_path=self.socket,
                get_generator=get_generator,
                status=lambda: wire.StatusResponse(peer_id="in-process", version="0", uptime_s=0),
                welcome=lambda: welcome,
            )
            self.token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as self.scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(api.serve)
                    self.ready.set()

    def __enter__(self) -> InProcessDaemon:
        self.thread.start()
        assert self.ready.wait(START_TIMEOUT_S), "the in-process daemon's socket did not open"
        if self.failure is not None:
            raise self.failure
        return self

    def __exit__(self, *exc: object) -> None:
        if self.scope is not None and self.token is not None:
            trio.from_thread.run_sync(self.scope.cancel, trio_token=self.token)
        self.thread.join(30)


async def _no_dht() -> None:
    """What SwarmView.refresh finds on a memnet: the records it holds already."""


@dataclass
class Tiny:
    """One family's tiny checkpoint, transformers and PEFT on it locally, and the swarm."""

    name: str
    checkpoint: Path
    local: Any  # transformers' whole model
    peft_model: Any  # PEFT's model with the adapter (on its own copy of the base)
    daemon: InProcessDaemon

    def distributed(self, **options: Any) -> DistributedModelForCausalLM:
        return AutoDistributedModelForCausalLM.from_pretrained(
            self.checkpoint, socket=self.daemon.socket, **options
        )


def sharded(name: str, directory: Path) -> Path:
    """The tiny model of `name` saved as the Hub ships large models: in several safetensors
    shards (3 or more) with a model.safetensors.index.json."""
    save_tiny(name, directory, max_shard_size=SHARD_SIZE)
    shards = list(directory.glob("*.safetensors"))
    assert len(shards) >= 3 and (directory / "model.safetensors.index.json").is_file(), shards
    return directory


def _load(checkpoint: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tiny]:
    name = request.param
    root = tmp_path_factory.mktemp(f"family-{name}")
    checkpoint = sharded(name, root / f"tiny-{name}")
    base = _load(checkpoint)
    torch.manual_seed(1)
    settings = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=lora_targets(base), init_lora_weights=False
    )
    peft_model = peft.get_peft_model(base, settings).eval()
    adapter = root / ADAPTER
    peft_model.save_pretrained(adapter)
    with InProcessDaemon(checkpoint, root / "peerd.sock", [adapter]) as daemon:
        yield Tiny(name, checkpoint, _load(checkpoint), peft_model, daemon)


def _ids(seed: int, rows: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_20_tokens_through_three_servers_equal_transformers(tiny: Tiny) -> None:
    prompt = _ids(10, 1, 8)
    expected = tiny.local.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    model = tiny.distributed()
    try:
        got = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        with torch.no_grad():
            logits = model(prompt).logits
    finally:
        model.close()
    assert got.tolist() == expected.tolist()
    with torch.no_grad():
        assert_close_scaled(logits, tiny.local(prompt).logits, rel=CHAINED)


def test_a_left_padded_batch_equals_each_prompt_alone(tiny: Tiny) -> None:
    """Three prompts of 5, 9 and 3 tokens, left-padded to 9, in one distributed call: each row's
    logits (at its real positions) and greedy tokens are those of the prompt alone (as
    transformers computes them; a single distributed call equals that, test above)."""
    prompts = [_ids(20 + i, 1, n)[0] for i, n in enumerate((5, 9, 3))]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    model = tiny.distributed()
    try:
        with torch.no_grad():
            batched = model(ids, attention_mask=mask).logits
        generated = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    finally:
        model.close()
    for row, prompt in enumerate(prompts):
        alone = prompt[None]
        with torch.no_grad():
            single = tiny.local(alone).logits
        assert_close_scaled(batched[row, width - len(prompt) :], single[0], rel=CHAINED)
        one = tiny.local.generate(alone, max_new_tokens=6, do_sample=False, pad_token_id=0)
        new = one[0, len(prompt) :].tolist()  # fewer than 6 if it reached EOS
        assert generated[row, width : width + len(new)].tolist() == new, row
        assert set(generated[row, width + len(new) :].tolist()) <= {0}, "padding after EOS"


def test_a_peft_lora_adapter_on_the_servers_gives_pefts_output(tiny: Tiny) -> None:
    ids = _ids(30, 2, 7)
    with torch.no_grad():
        expected = tiny.peft_model(ids).logits
        with tiny.peft_model.disable_adapter():
            plain = tiny.peft_model(ids).logits
    model = tiny.distributed(active_adapter=ADAPTER)
    try:
        with torch.no_grad():
            got = model(ids).logits
        greedy = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    finally:
        model.close()
    assert_close_scaled(got, expected, rel=CHAINED)
    assert float((got - plain).abs().max()) > 1e-3 * float(plain.abs().max()), "adapter unused"
    with torch.no_grad():
        reference = tiny.peft_model.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False)
    assert greedy.tolist() == reference.tolist()


def test_deep_prompt_tuning_gradients_equal_local_autograd(tiny: Tiny) -> None:
    tuned = tiny.distributed(tuning_mode="deep_ptune", pre_seq_len=PREFIX)
    try:
        torch.manual_seed(40)
        with torch.no_grad():
            assert tuned.prompt_embeddings is not None
            assert tuned.intermediate_prompt_embeddings is not None
            tuned.prompt_embeddings.normal_(0, 0.05)
            tuned.intermediate_prompt_embeddings.normal_(0, 0.05)
        ids = _ids(41, 3, 9)
        labels = ids.clone()
        labels[:, :4] = -100
        loss = tuned(ids, labels=labels).loss
        loss.backward()
        shallow, deep = tuned.prompt_embeddings, tuned.intermediate_prompt_embeddings
        ref_loss, ref_shallow, ref_deep = local_prompt_gradients(
            tiny.local, ids, labels, shallow, deep
        )
    finally:
        tuned.close()
    assert math.isclose(float(loss.detach()), ref_loss, rel_tol=1e-5)
    assert shallow.grad is not None and deep.grad is not None
    assert relative_error(shallow.grad, ref_shallow) < GRAD_TOLERANCE
    assert relative_error(deep.grad, ref_deep) < GRAD_TOLERANCE


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def local_prompt_gradients(
    model: Any, ids: torch.Tensor, labels: torch.Tensor, shallow: torch.Tensor, deep: torch.Tensor
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Loss and prompt gradients by plain autograd on the whole model: shallow prompts before
    the token embeddings, block i's deep prompt added to the first positions of its input by a
    hook on that decoder layer."""
    shallow = shallow.detach().clone().requires_grad_(True)
    deep = deep.detach().clone().requires_grad_(True)
    prefix = shallow.shape[0]

    def add_prompt(index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = torch.cat([hidden[:, :prefix] + deep[index], hidden[:, prefix:]], 1)
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        return hook

    layers = decoder_layers(model)
    hooks = [
        layer.register_forward_pre_hook(add_prompt(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        embeds = model.get_input_embeddings()(ids)
        inputs = torch.cat([shallow.unsqueeze(0).expand(ids.shape[0], -1, -1), embeds], 1)
        logits = model(inputs_embeds=inputs).logits[:, prefix:].contiguous()
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    assert shallow.grad is not None and deep.grad is not None
    return float(loss.detach()), shallow.grad, deep.grad


def test_an_adapter_on_blocks_of_different_shapes_is_read_per_block(tmp_path: Path) -> None:
    """Qwen2-MoE with a dense first block (mlp_only_layers): its adapter changes mlp.down_proj
    in block 0 and mlp.shared_expert.down_proj in block 1, each checked against its own block."""
    from transformers import Qwen2MoeConfig

    if "qwen2_moe" not in blocks.FAMILIES:
        pytest.skip("no qwen2_moe family yet")
    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    base.save_pretrained(tmp_path / "moe")
    settings = peft.LoraConfig(r=2, target_modules=["down_proj"], init_lora_weights=False)
    peft.get_peft_model(base, settings).save_pretrained(tmp_path / "a")
    loaded = blocks.load_config(tmp_path / "moe")
    info = blocks.read_adapter(tmp_path / "a", loaded, blocks.family_of(loaded))
    assert any("layers.0.mlp.down_proj" in name for name in info.tensor_names)
    assert any("layers.1.mlp.shared_expert.down_proj" in name for name in info.tensor_names)
    span = blocks.load_span(tmp_path / "moe", 0, 2, adapters=[tmp_path / "a"])
    assert span.adapters == ("a",)


# --- through real daemons ------------------------------------------------------------------

# Newer families for the multi-process check, in order of preference (the first two present run):
# alternating sliding/global attention with two rotary bases, and q/k norms with experts.
DAEMON_FAMILIES = ("gemma3_text", "qwen3_moe", "gemma2", "qwen2_moe", "mistral", "qwen3")
DAEMON_DEADLINE_S = 120.0  # two daemons see each other (generous: a loaded 2-core CI machine)


def _serve(checkpoint: Path, swarm: LocalSwarm, spans: int) -> None:
    """`checkpoint` in `spans` daemons of `swarm` (1: all its blocks; 2: blocks 0:2 and the
    rest), the first seeing every one of them online."""
    num_blocks = int(blocks.load_config(checkpoint).num_hidden_layers)
    ranges = [f"0:{num_blocks}"] if spans == 1 else ["0:2", f"2:{num_blocks}"]
    for name, blocks_range in zip("ab", ranges, strict=False):
        swarm.start(name, blocks_range, "--model", str(checkpoint))
    with Client(swarm.daemons[0].socket) as client:
        deadline = time.monotonic() + DAEMON_DEADLINE_S
        while len([s for s in client.status().swarm if s.state == "online"]) < spans:
            assert time.monotonic() < deadline, "the daemons did not see each other"
            time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_new_families_through_real_daemons_equal_transformers(tmp_path: Path) -> None:
    """Two newer families in `peerd start` daemons: the first split over two (blocks 0:2 and the
    rest, a hop over libp2p), the second whole in one (three daemons in all, to keep CI short;
    the two swarms start side by side). Greedy 20 tokens through AutoDistributedModelForCausalLM
    on each swarm's first daemon equal transformers'."""
    chosen = [name for name in DAEMON_FAMILIES if name in TINY_CONFIGS][:2]
    assert len(chosen) == 2, f"tests/tiny_models.py has fewer than two of {DAEMON_FAMILIES}"
    checkpoints = [sharded(name, tmp_path / f"tiny-{name}") for name in chosen]
    swarms = [LocalSwarm() for _ in chosen]
    try:
        with ThreadPoolExecutor(len(chosen)) as pool:
            starts = [
                pool.submit(_serve, checkpoint, swarm, spans)
                for checkpoint, swarm, spans in zip(checkpoints, swarms, (2, 1), strict=True)
            ]
            for started in starts:
                started.result()
        prompt = _ids(50, 1, 8)
        for name, checkpoint, swarm in zip(chosen, checkpoints, swarms, strict=True):
            local = _load(checkpoint)
            expected = local.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            model = AutoDistributedModelForCausalLM.from_pretrained(
                checkpoint, socket=swarm.daemons[0].socket
            )
            try:
                got = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            finally:
                model.close()
            assert got.tolist() == expected.tolist(), name
    finally:
        for swarm in swarms:
            swarm.stop()
