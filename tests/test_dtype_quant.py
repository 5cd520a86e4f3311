"""Serving dtype, device and weight quantization (peerd start --device --dtype --quant): what a
block costs in memory, measured against what block_bytes predicts; how many blocks `--blocks
auto` takes; greedy decoding through an in-process swarm in bfloat16 against transformers'
own; perplexity on a shipped English text through the swarm in every dtype and quantization.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, MixtralConfig, PretrainedConfig

import blocks
from blocks.memory import _meta_block
from blocks.quant import held_bytes, quantize_linears
from blocks.serving import ServingError, resolve_serving
from peerd.daemon.main import blocks_to_serve

TEXT = Path(__file__).parent / "data" / "lighthouses.txt"
BF16 = torch.bfloat16
# (dtype, quant) -> the most a block may take against float32 (issue 18's acceptance).
RATIOS = {(BF16, "none"): 0.52, (BF16, "int8"): 0.30, (BF16, "nf4"): 0.18}


def llama3_8b_shaped() -> PretrainedConfig:
    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
    )


def mixtral_shaped() -> PretrainedConfig:
    """Mixtral 8x7B's proportions (8 experts, 2 per token, 4:1 grouped KV) at 1/8 the width."""
    return MixtralConfig(
        hidden_size=512,
        intermediate_size=1792,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=1000,
    )


def random_block(config: PretrainedConfig, dtype: torch.dtype, quant: str) -> nn.Module:
    """Block 0 of `config` with random weights in `dtype`, quantized as `quant` says: built on
    the meta device and given memory one block at a time, as load_span does."""
    layer = _meta_block(config).to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    return quantize_linears(layer, quant, dtype, "cpu")


def test_serving_flags_resolve_here_or_say_why() -> None:
    cpu_only = not torch.cuda.is_available()
    if cpu_only:
        assert resolve_serving("auto", "auto") == blocks.Serving("cpu", torch.float32, "none")
        with pytest.raises(ServingError, match=r"--device cuda:0: .*give cpu or auto"):
            resolve_serving("cuda:0")
    assert resolve_serving("cpu", "bfloat16", "nf4").describe() == "cpu bfloat16 nf4"
    with pytest.raises(ServingError, match=r"--dtype float8: expected auto, float32"):
        resolve_serving("cpu", "float8")
    with pytest.raises(ServingError, match=r"--quant int4: expected none, int8, nf4"):
        resolve_serving("cpu", "float32", "int4")
    with pytest.raises(ServingError, match=r"--device tpu: expected auto, cpu, cuda"):
        resolve_serving("tpu")


def test_default_model_blocks_in_each_dtype_and_quant_take_what_block_bytes_says() -> None:
    checkpoint = blocks.resolve_checkpoint("default")
    config = blocks.load_config(checkpoint)
    full = held_bytes(blocks.load_span(checkpoint, 0, 1, torch.float32).layers)
    assert full == blocks.block_bytes(config, torch.float32)
    for (dtype, quant), most in RATIOS.items():
        span = blocks.load_span(checkpoint, 0, 1, dtype, quant=quant)
        assert (span.dtype, span.quant) == (dtype, quant)
        held = held_bytes(span.layers)
        assert held / full <= most, (dtype, quant, held / full)
        predicted = blocks.block_bytes(config, dtype, quant)
        assert abs(predicted - held) <= 0.05 * held, (dtype, quant, predicted, held)


@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_block_bytes_predicts_a_mixtral_shaped_block(quant: str) -> None:
    """Experts are fused parameters, not linear layers: they stay in the serving dtype and
    count fully; the attention projections and the router are quantized."""
    config = mixtral_shaped()
    held = held_bytes(random_block(config, BF16, quant))
    predicted = blocks.block_bytes(config, BF16, quant)
    assert abs(predicted - held) <= 0.05 * held, (quant, predicted, held)


@pytest.mark.slow
def test_llama3_8b_shaped_block_memory_and_prediction() -> None:
    config = llama3_8b_shaped()
    full = blocks.block_bytes(config, torch.float32)  # exact for plain weights (test above)
    for (dtype, quant), most in RATIOS.items():
        held = held_bytes(random_block(config, dtype, quant))
        assert held / full <= most, (dtype, quant, held / full)
        predicted = blocks.block_bytes(config, dtype, quant)
        assert abs(predicted - held) <= 0.05 * held, (dtype, quant, predicted, held)


def test_blocks_auto_with_nf4_takes_three_times_the_float32_blocks() -> None:
    config = llama3_8b_shaped()
    budget, cache_tokens = 8 << 30, 4096
    plain = blocks_to_serve(config, budget, cache_tokens)
    nf4 = blocks_to_serve(config, budget, cache_tokens, serving=blocks.Serving(quant="nf4"))
    assert plain >= 1 and nf4 >= 3 * plain, (plain, nf4)
    half = blocks_to_serve(config, budget, cache_tokens, serving=blocks.Serving(dtype=BF16))
    assert half >= 2 * plain - 1


def perplexity(client: blocks.ClientSide, ids: torch.Tensor, hidden: torch.Tensor) -> float:
    """exp(mean cross-entropy) of each next token given the hidden states of those before it."""
    with torch.inference_mode():
        logits = client.logits(hidden[:, :-1]).float()
    loss = nn.functional.cross_entropy(logits[0], ids[0, 1:])
    return math.exp(float(loss))
