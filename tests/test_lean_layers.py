"""blocks.lean: the leaner forward of Llama-shaped layers against transformers' own layer with the
same weights, case by case (a prompt from position 0, a decode step through a KV cache, a prompt
after a past, left-padded rows, a sliding window, grouped and ungrouped heads, biases, gradients,
half precision). Whole spans of every family are compared with transformers' whole model in
test_blocks; this pins each path of the layer itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2

from blocks import lean
from blocks.cache import KVCache
from blocks.families import FAMILIES, prepare_config
from blocks.layer_inputs import RowMasks, rotary_inputs, rotary_masked

SHAPE = {"hidden_size": 48, "num_attention_heads": 6, "intermediate_size": 80}
CASES: dict[str, tuple[PretrainedConfig, type[nn.Module], type[nn.Module]]] = {
    "llama-gqa": (
        LlamaConfig(**SHAPE, num_key_value_heads=2),
        modeling_llama.LlamaDecoderLayer,
        lean.LlamaLayer,
    ),
    "llama-mha-bias": (
        LlamaConfig(**SHAPE, num_key_value_heads=6, attention_bias=True, mlp_bias=True),
        modeling_llama.LlamaDecoderLayer,
        lean.LlamaLayer,
    ),
    "mistral-window": (
        MistralConfig(**SHAPE, num_key_value_heads=3, sliding_window=5),
        modeling_mistral.MistralDecoderLayer,
        lean.MistralLayer,
    ),
    "qwen2": (
        Qwen2Config(**SHAPE, num_key_value_heads=2, num_hidden_layers=1),
        modeling_qwen2.Qwen2DecoderLayer,
        lean.Qwen2Layer,
    ),
}


def _pair(
    name: str, dtype: torch.dtype = torch.float32
) -> tuple[PretrainedConfig, nn.Module, nn.Module]:
    config, theirs, ours = CASES[name]
    family = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}[name.split("-")[0]]
    prepare_config(config, FAMILIES[family])
    torch.manual_seed(0)
    reference = theirs(config, layer_idx=0)
    for p in reference.parameters():  # large enough that a wrong path shows in the outputs
        nn.init.normal_(p, std=0.3)
    leaned = ours(config, layer_idx=0)
    leaned.load_state_dict(reference.state_dict())
    return config, reference.to(dtype).eval(), leaned.to(dtype).eval()


def _close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-5) -> None:
    """Equal up to float rounding, which scales with the values compared."""
    scale = theirs.abs().max().item()
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=rel * scale)


def _rotary(config: PretrainedConfig) -> nn.Module:
    return modeling_llama.LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("name", list(CASES))
def test_a_prompt_then_decode_steps_through_the_cache_match_transformers(name: str) -> None:
    config, reference, leaned = _pair(name)
    rotary = _rotary(config)
    caches = [KVCache(0, 1, 64), KVCache(0, 1, 64)]
    torch.manual_seed(1)
    # A prompt from position 0 (no mask: causal sdpa), one more after it (an explicit mask, and
    # past the window for mistral), then single tokens (no mask until the window slides).
    for tokens in (7, 4, 1, 1, 1):
        hidden = torch.randn(2, tokens, config.hidden_size)
        past = caches[0].length
        inputs = rotary_inputs(config, rotary, hidden, past)
        with torch.inference_mode():
            outs = [
                layer(hidden, **inputs, cache=cache)
                for layer, cache in zip((reference, leaned), caches, strict=True)
            ]
        for cache in caches:
            cache.length += tokens
        _close(outs[1], outs[0])


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_rows_of_their_own_past_and_padding_match_transformers(name: str) -> None:
    config, reference, leaned = _pair(name)
    rotary = _rotary(config)
    hidden = torch.randn(3, 6, config.hidden_size)
    window = getattr(config, "sliding_window", None)
    rows = RowMasks.build(torch.tensor([0, 0, 0]), torch.tensor([0, 2, 5]), 6, 6, window)
    inputs = rotary_masked(config, rotary, hidden, rows)
    with torch.inference_mode():
        theirs = reference(hidden, **inputs, cache=KVCache(0, 1, 8))
        ours = leaned(hidden, **inputs, cache=KVCache(0, 1, 8))
    _close(ours, theirs)
    # One token each after it, with the rows' masks (the pack-GQA path in transformers).
    step = torch.randn(3, 1, config.hidden_size)
    rows = RowMasks.build(torch.tensor([6, 6, 6]), torch.tensor([0, 2, 5]), 1, 7, window)
    inputs = rotary_masked(config, rotary, step, rows)
    caches = [KVCache(0, 1, 8), KVCache(0, 1, 8)]
    with torch.inference_mode():
        for layer, cache in zip((reference, leaned), caches, strict=True):
            layer(
                hidden,
                **rotary_masked(
                    config,
                    rotary,
                    hidden,
                    RowMasks.build(torch.tensor([0, 0, 0]), torch.tensor([0, 2, 5]), 6, 6, window),
                ),
                cache=cache,
            )
            cache.length = 6
        outs = [
            layer(step, **inputs, cache=cache)
            for layer, cache in zip((reference, leaned), caches, strict=True)
        ]
    _close(outs[1], outs[0])


def test_gradients_reach_the_input_and_every_weight_as_in_transformers() -> None:
    config, reference, leaned = _pair("llama-mha-bias")
    rotary = _rotary(config)
    hidden = torch.randn(2, 5, config.hidden_size)
    inputs = rotary_inputs(config, rotary, hidden, 0)
    grads = []
    for layer in (reference, leaned):
        layer.train()
        x = hidden.clone().requires_grad_(True)
        layer(x, **inputs).square().sum().backward()
        assert x.grad is not None
        grads.append({"input": x.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for key, theirs in grads[0].items():
        ours = grads[1][key]
        assert ours is not None and theirs is not None, key
        _close(ours, theirs, rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_transformers_in_that_precision(dtype: torch.dtype) -> None:
    config, reference, leaned = _pair("llama-gqa", dtype)
    rotary = _rotary(config)
    hidden = torch.randn(1, 6, config.hidden_size, dtype=dtype)
    inputs = rotary_inputs(config, rotary, hidden, 0)
    with torch.inference_mode():
        theirs, ours = reference(hidden, **inputs), leaned(hidden, **inputs)
    _close(ours, theirs, rel=2e-2)  # a half's rounding, where the kernels' orders differ


def test_the_llama_shaped_families_run_the_lean_layers_with_transformers_weight_names() -> None:
    assert FAMILIES["llama"].layer_class is lean.LlamaLayer
    assert FAMILIES["mistral"].layer_class is lean.MistralLayer
    assert FAMILIES["qwen2"].layer_class is lean.Qwen2Layer
    _, reference, leaned = _pair("llama-gqa")
    assert list(leaned.state_dict()) == list(reference.state_dict())
    assert isinstance(leaned, modeling_llama.LlamaDecoderLayer)
