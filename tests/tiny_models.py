"""Tiny random models of every family peerd runs, built with transformers' config classes and
saved to disk (save_tiny) so tests run the real loading path. Every test that covers "each family"
iterates TINY_CONFIGS; FAMILY_OF_CONFIG names the family of the variants (falcon-alibi...)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 96
# Large initial weights and untied heads keep these random models from repeating one token.
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "initializer_range": 0.5}
UNTIED = {**SMALL, "tie_word_embeddings": False}
FOUR_LAYERS = {"num_hidden_layers": 4, "num_key_value_heads": 2, "intermediate_size": 64}
# Special tokens inside the tiny vocabulary (some configs default to ids past it).
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
TINY_CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(
        **UNTIED, num_hidden_layers=6, num_key_value_heads=2, intermediate_size=64
    ),
    "bloom": BloomConfig(**UNTIED, n_layer=4),
    # Falcon-7B-like: rotary, multi-query, parallel attention.
    "falcon": FalconConfig(**UNTIED, num_hidden_layers=4),
    # Falcon-RW-like: ALiBi, separate heads, sequential attention, biases.
    "falcon-alibi": FalconConfig(
        **UNTIED,
        num_hidden_layers=4,
        alibi=True,
        multi_query=False,
        parallel_attn=False,
        bias=True,
    ),
    # Falcon-40B-like: grouped KV heads, two layer norms; LM head tied to the embeddings.
    "falcon-new": FalconConfig(
        **SMALL, num_hidden_layers=4, new_decoder_architecture=True, num_kv_heads=2
    ),
    "mixtral": MixtralConfig(
        **SMALL,
        num_hidden_layers=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,  # shorter than the sequences below, so the window matters
    ),
    # Llama 3.1/3.2 rope scaling; a short original context, so it changes most frequencies.
    "llama3": LlamaConfig(
        **UNTIED,
        num_hidden_layers=4,
        num_key_value_heads=2,
        intermediate_size=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # Sliding and full layers in one span (layer_types), a window shorter than the prompts.
    "qwen2": Qwen2Config(
        **UNTIED,
        **FOUR_LAYERS,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "qwen3": Qwen3Config(**UNTIED, **FOUR_LAYERS, head_dim=8),  # q/k norms
    "mistral": MistralConfig(**UNTIED, **FOUR_LAYERS, sliding_window=8),
    "phi3": Phi3Config(**UNTIED, **FOUR_LAYERS, **TOKENS),
    "olmo2": Olmo2Config(**UNTIED, **FOUR_LAYERS, **TOKENS),
    # Attention and final logit soft-capping, scaled embeddings.
    "gemma2": Gemma2Config(
        **UNTIED,
        **FOUR_LAYERS,
        **TOKENS,
        head_dim=8,
        sliding_window=8,
        final_logit_softcapping=15.0,
    ),
    "gemma3_text": Gemma3TextConfig(
        **UNTIED,
        **FOUR_LAYERS,
        **TOKENS,
        head_dim=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "qwen2_moe": Qwen2MoeConfig(
        **UNTIED,
        **FOUR_LAYERS,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    ),
    "qwen3_moe": Qwen3MoeConfig(
        **UNTIED,
        **FOUR_LAYERS,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    ),
}
FAMILY_OF_CONFIG = {"falcon-alibi": "falcon", "falcon-new": "falcon", "llama3": "llama"}


def save_tiny(name: str, directory: Path, **save_kwargs: object) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name])
    model.save_pretrained(directory, **save_kwargs)
    return directory


def llama_for_tokenizer(tokenizer: Any, **sizes: Any) -> LlamaConfig:
    """A tiny untied llama config for `tokenizer`'s vocabulary and special tokens (the default
    model's, so daemons can decode and chat with it); `sizes` override the tiny shape."""
    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": 0.5,
    }
    return LlamaConfig(
        **{**shape, **sizes},
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
