"""LoRA adapters on spans (blocks/lora.py): PEFT's saved adapters, read by peerd and applied beside
the base weights, must give what the PEFT model itself computes; what peerd cannot apply exactly
is refused when the adapter is read, with a message that says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import blocks
import wire
from blocks.lora import AdapterError
from tests.numeric import CHAINED, SAME, assert_close_scaled

peft = pytest.importorskip("peft")

CONFIG = LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.5,
    tie_word_embeddings=False,
)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base: Any, directory: Path, seed: int = 1, **lora: Any) -> tuple[Any, Path]:
    """A PEFT LoRA adapter on `base` with random (non-zero) A and B, saved to `directory`."""
    torch.manual_seed(seed)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ALL_LINEAR, **lora}
    config = peft.LoraConfig(init_lora_weights=False, **settings)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lora") / "tiny-llama"
    AutoModelForCausalLM.from_config(CONFIG).save_pretrained(path)
    return path


def fresh_base(tiny: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def hidden_states(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs of every block (index i is block i's input; the last entry is normed, unused)."""
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("rslora", [False, True])
def test_span_with_adapter_matches_peft_within_1e5(
    tiny: Path, tmp_path: Path, rslora: bool
) -> None:
    peft_model, adapter = save_adapter(fresh_base(tiny), tmp_path / "shout", use_rslora=rslora)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    with peft_model.disable_adapter():
        plain = hidden_states(peft_model, ids)
    adapted = hidden_states(peft_model, ids)
    span = blocks.load_span(tiny, 1, 3, adapters=[adapter])
    assert span.adapters == ("shout",)
    with torch.no_grad():
        ours = span(adapted[1], adapter="shout")
        base = span(plain[1])  # the same span serves plain requests: weights were not merged
    assert_close_scaled(ours, adapted[3], rel=SAME)
    assert_close_scaled(base, plain[3], rel=SAME)
    changed = float((ours - span(adapted[1])).abs().max())
    assert changed > 1e-4 * float(ours.abs().max()), "the adapter must change the output"


def test_cached_decoding_with_an_adapter_matches_peft(tiny: Path, tmp_path: Path) -> None:
    """Prefill then token-by-token with a KV cache, through two spans (as two servers run it)."""
    peft_model, adapter = save_adapter(fresh_base(tiny), tmp_path / "a", target_modules=["v_proj"])
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    expected = hidden_states(peft_model, ids)[CONFIG.num_hidden_layers - 1]
    first = blocks.load_span(tiny, 0, 2, adapters=[adapter])
    second = blocks.load_span(tiny, 2, 3, adapters=[adapter])
    embedded = hidden_states(peft_model, ids)[0]
    cache = blocks.MemoryCache(budget_tokens=64)
    outputs = []
    with cache.open_session(1, 16) as s1, cache.open_session(1, 16) as s2:
        for piece in (embedded[:, :6], embedded[:, 6:7], embedded[:, 7:9]):
            outputs.append(second(first(piece, s1, "a"), s2, "a"))
    # Values reach ~150 here; cached attention over pieces rounds differently from one full
    # pass by ~2e-4 with or without an adapter (1e-6 of the scale).
    assert_close_scaled(torch.cat(outputs, 1), expected, rel=CHAINED)


def test_two_adapters_and_plain_requests_share_one_span(tiny: Path, tmp_path: Path) -> None:
    one, path_one = save_adapter(fresh_base(tiny), tmp_path / "one", seed=1)
    two, path_two = save_adapter(fresh_base(tiny), tmp_path / "two", seed=2, r=2, lora_alpha=3)
    span = blocks.load_span(tiny, 0, 4, adapters=[path_one, path_two])
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(5))
    embedded = hidden_states(one, ids)[0]
    with torch.no_grad():
        for name, model in (("one", one), ("two", two)):
            ours = final_norm(model, span(embedded, adapter=name))
            assert_close_scaled(ours, hidden_states(model, ids)[-1], rel=SAME)
        with one.disable_adapter():
            plain = hidden_states(one, ids)[-1]
        assert_close_scaled(final_norm(one, span(embedded)), plain, rel=SAME)
    # Only the span's own blocks were read.
    part = blocks.load_span(tiny, 2, 3, adapters=[path_one])
    wrapped = [m for m in part.modules() if isinstance(m, blocks.lora.LoraLinear)]
    assert len(wrapped) == len(ALL_LINEAR)


def final_norm(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm, to compare with transformers' last hidden state (which is normed)."""
    return model.get_base_model().model.norm(hidden)


def test_an_adapter_the_span_lacks_is_a_typed_error(tiny: Path, tmp_path: Path) -> None:
    span = blocks.load_span(tiny, 0, 2)
    with pytest.raises(AdapterError, match=r"no adapter 'x'.*--adapters"):
        span(torch.zeros(1, 2, 32), adapter="x")


def _edit_config(adapter: Path, **changes: Any) -> Path:
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"peft_type": "IA3"}, "PEFT type 'IA3'; peerd serves LORA adapters only"),
        ({"bias": "all"}, "trains biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ],
)
def test_unsupported_adapter_features_are_refused_when_read(
    tiny: Path, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    _, adapter = save_adapter(fresh_base(tiny), tmp_path / "bad", target_modules=["q_proj"])
    _edit_config(adapter, **changes)
    with pytest.raises(AdapterError, match=message):
        blocks.load_span(tiny, 0, 2, adapters=[adapter])


def test_adapters_outside_the_blocks_or_for_another_model_are_refused(
    tiny: Path, tmp_path: Path
) -> None:
    _, head = save_adapter(
        fresh_base(tiny), tmp_path / "head", target_modules=["q_proj", "lm_head"]
    )
    with pytest.raises(AdapterError, match=r"'lm_head'.*run on each client"):
        blocks.load_span(tiny, 0, 2, adapters=[head])
    wider = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**CONFIG.to_dict(), "intermediate_size": 48})
    )
    _, other = save_adapter(wider, tmp_path / "other", target_modules=["up_proj"])
    with pytest.raises(AdapterError, match=r"32->64 linear layer.*trained for another model"):
        blocks.load_span(tiny, 0, 2, adapters=[other])
    deeper = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 6})
    )
    _, deep = save_adapter(deeper, tmp_path / "deep", target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"block [45], but the model has blocks 0:4"):
        blocks.load_span(tiny, 0, 2, adapters=[deep])
    with pytest.raises(AdapterError, match=r"no adapter_config.json"):
        blocks.load_span(tiny, 0, 2, adapters=[tmp_path])


def test_daemon_refuses_a_bad_adapter_at_start(tiny: Path, tmp_path: Path) -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair

    from peerd.daemon.main import Daemon, DaemonConfig, DaemonError

    key = create_new_key_pair()
    _, adapter = save_adapter(fresh_base(tiny), tmp_path / "dora", target_modules=["q_proj"])
    _edit_config(adapter, use_dora=True)
    with pytest.raises(DaemonError, match=r"--adapters .*dora.*DoRA"):
        Daemon(DaemonConfig(model=str(tiny), blocks="0:2", adapters=[adapter]), key)
    # Shapes are checked at start too (on a meta-device layer), not only when blocks load.
    wider = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**CONFIG.to_dict(), "intermediate_size": 48})
    )
    _, other = save_adapter(wider, tmp_path / "wider", target_modules=["down_proj"])
    with pytest.raises(DaemonError, match=r"down_proj is a 64->32 linear layer.*another model"):
        Daemon(DaemonConfig(model=str(tiny), blocks="0:2", adapters=[other]), key)
    _edit_config(adapter, use_dora=False)
    with pytest.raises(DaemonError, match="--adapters needs --blocks"):
        Daemon(DaemonConfig(model=str(tiny), blocks=None, adapters=[adapter]), key)
    assert Daemon(DaemonConfig(model=str(tiny), blocks="0:2", adapters=[adapter]), key).adapters


async def test_a_server_without_the_adapter_refuses_the_session(tiny: Path, tmp_path: Path) -> None:
    from peerd.server.block_server import AdapterMissing, BlockServer
    from peerd.server.compute import ComputeQueue

    _, adapter = save_adapter(fresh_base(tiny), tmp_path / "shout", target_modules=["q_proj"])
    server = BlockServer(
        model="tiny-llama", start=0, end=2, compute=ComputeQueue(), peer_id="me",
        addrs=lambda: [], adapters=("shout",),
    )  # fmt: skip
    server.go_online(blocks.load_span(tiny, 0, 2, adapters=[adapter]), blocks.MemoryCache(64), 1)
    assert server.record().adapters == ("shout",)

    def request(adapter: str | None) -> wire.OpenSession:
        return wire.OpenSession(
            session_id="s", model="tiny-llama", start=0, end=2, max_length=8,
            active_adapter=adapter,
        )  # fmt: skip

    with pytest.raises(AdapterMissing, match=r"no adapter 'other'.*has: shout"):
        server.open_local(request("other"))
    session = server.open_local(request("shout"))
    # Tokens that differ: with three equal ones every query weighs the same values alike, and an
    # adapter on q_proj alone could change nothing.
    hidden = torch.linspace(-1, 1, 3 * 32).reshape(1, 3, 32)
    out = await session.step(hidden, None)
    plain = server.open_local(request(None))
    assert not torch.allclose(out, await plain.step(hidden, None))
