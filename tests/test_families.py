"""What the families beyond Llama's shape add, each against transformers' own model: memory sizing
per family, rope scaling reaching the rotary module, Gemma's scaled embeddings and soft-capped
logits on every path to them, per-layer attention kinds, and MoE checkpoints' expert layout.
(Parity of spans, generation and batching per family: tests/test_blocks.py.)"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma3TextConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import blocks
from blocks.errors import CheckpointError
from tests.numeric import SAME, assert_close_scaled
from tests.tiny_models import FAMILY_OF_CONFIG, TINY_CONFIGS, VOCAB, save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: save_tiny(name, root / name) for name in TINY_CONFIGS}


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_block_bytes_are_the_loaded_blocks_bytes_in_every_family(
    tiny: dict[str, Path], name: str
) -> None:
    """`--blocks auto` sizes a span by block_bytes: it must be what a loaded block takes."""
    span = blocks.load_span(tiny[name], 1, 2)
    real = sum(t.numel() * t.element_size() for t in (*span.parameters(), *span.layers.buffers()))
    assert blocks.block_bytes(TINY_CONFIGS[name], torch.float32) == real
    assert span.family.name == FAMILY_OF_CONFIG.get(name, name)


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_llama3_rope_scaling_reaches_the_rotary_module(
    tiny: dict[str, Path], layout: str, tmp_path: Path
) -> None:
    """Both config.json layouts: transformers 5's `rope_parameters`, and the `rope_scaling` +
    `rope_theta` that Llama 3.1/3.2 checkpoints on the Hub carry."""
    path = tiny["llama3"]
    if layout == "rope_scaling":
        config = json.loads((path / "config.json").read_text())
        scaling = config.pop("rope_parameters")
        config["rope_theta"] = scaling.pop("rope_theta")
        config["rope_scaling"] = scaling
        shutil.copytree(path, tmp_path / "hub-layout")
        path = tmp_path / "hub-layout"
        (path / "config.json").write_text(json.dumps(config))
    span = blocks.load_span(path, 0, 2)
    assert span.config.rope_parameters["rope_type"] == "llama3"
    plain = LlamaRotaryEmbedding(blocks.load_config(tiny["llama"]))
    assert span.rotary is not None
    # The lowest frequencies are divided by the factor (8), and with an original context of 16
    # tokens every other one is smoothed towards that: none is the default rope's.
    ratio = plain.inv_freq / span.rotary.inv_freq
    assert ratio.max() == pytest.approx(8.0) and ratio.min() > 1.5


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_gemma_embeddings_are_scaled_and_logits_soft_capped_on_every_path(
    tiny: dict[str, Path], name: str
) -> None:
    """The SDK calls client.embeddings and client.lm_head directly (HF-style get_input_embeddings),
    so the scale and the cap live in those modules, not only in embed() and logits()."""
    path = tiny[name]
    client = blocks.load_client_side(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        want_embedded = reference.get_input_embeddings()(ids)
        assert_close_scaled(client.embed(ids), want_embedded, rel=SAME)
        assert_close_scaled(client.embeddings(ids), want_embedded, rel=SAME)
        hidden = torch.randn(1, 5, 32) * 50
        want = reference.lm_head(reference.model.norm(hidden))
        cap = TINY_CONFIGS[name].final_logit_softcapping
        if cap is not None:
            want = torch.tanh(want / cap) * cap
            assert client.logits(hidden).abs().max() <= cap
        assert_close_scaled(client.logits(hidden), want, rel=SAME)
        assert_close_scaled(client.lm_head(client.final_norm(hidden)), want, rel=SAME)


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3_text"])
def test_each_layer_of_a_span_gets_its_own_kind_of_attention(
    tiny: dict[str, Path], name: str
) -> None:
    """Sliding and full layers alternate; a span starting at an odd block must still give block
    b the kind transformers gives it. Beyond the window the two kinds differ, so a span that
    gave every layer the same mask would miss transformers' hidden states."""
    path = tiny[name]
    config = TINY_CONFIGS[name]
    assert {config.layer_types[1], config.layer_types[2]} == {"sliding_attention", "full_attention"}
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 3 * config.sliding_window))
    with torch.no_grad():
        states = reference(ids, output_hidden_states=True).hidden_states
        span = blocks.load_span(path, 1, 3)
        assert_close_scaled(span(states[1]), states[3])
        cache = blocks.MemoryCache(budget_tokens=100)
        with cache.open_session(1, ids.shape[1]) as session:
            half = ids.shape[1] // 2
            stepped = torch.cat(
                [span(states[1][:, :half], session), span(states[1][:, half:], session)], 1
            )
        assert_close_scaled(stepped, states[3])


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_a_moe_checkpoint_missing_an_expert_says_which(
    tiny: dict[str, Path], name: str, tmp_path: Path
) -> None:
    source = tiny[name]
    weights = load_file(source / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in weights  # as save_pretrained lays out
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    blocks.load_span(tmp_path, 0, 1)  # block 0 is whole
    with pytest.raises(CheckpointError, match=r"lacks model\.layers\.1\.|lacks mlp\.experts\.3\."):
        blocks.load_span(tmp_path, 1, 2)


def test_a_bidirectional_gemma_is_refused_at_start() -> None:
    """Gemma 3 embedding checkpoints attend both ways: no causal span can run them."""
    config = Gemma3TextConfig(
        **{**TINY_CONFIGS["gemma3_text"].to_dict(), "use_bidirectional_attention": True}
    )
    with pytest.raises(blocks.UnsupportedModelError, match="causal language models only"):
        blocks.block_bytes(config, torch.float32)


def test_a_layer_kind_peerd_cannot_mask_is_refused_at_start() -> None:
    config = copy.deepcopy(TINY_CONFIGS["qwen2"])
    config.layer_types = ["sliding_attention", "chunked_attention"] * 2
    with pytest.raises(blocks.UnsupportedModelError, match="layers of kind chunked_attention"):
        blocks.block_bytes(config, torch.float32)


def test_a_qwen2_moe_with_dense_layers_runs_as_transformers(tmp_path: Path) -> None:
    """mlp_only_layers / decoder_sparse_step make some blocks dense MLPs: those keep their names,
    the others' experts are fused."""
    config = copy.deepcopy(TINY_CONFIGS["qwen2_moe"])
    config.mlp_only_layers = [0, 3]
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_path, max_shard_size="64KB")
    client = blocks.load_client_side(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        hidden = client.embed(ids)
        for start in (0, 2):
            hidden = blocks.load_span(tmp_path, start, start + 2)(hidden)
        assert_close_scaled(client.logits(hidden), reference(ids).logits)
