"""Tiny random models of every family peerd runs, built with transformers' config classes and
saved to disk (save_tiny) so tests run the real loading path. Every test that covers "each family"
iterates TINY_CONFIGS; FAMILY_OF_CONFIG names the family of the variants (falcon-alibi...)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
)

VOCAB = 96
# Large initial weights and untied heads keep these random models from repeating one token.
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "initializer_range": 0.5}
UNTIED = {**SMALL, "tie_word_embeddings": False}
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
}
FAMILY_OF_CONFIG = {"falcon-alibi": "falcon", "falcon-new": "falcon"}


def save_tiny(name: str, directory: Path, **save_kwargs: object) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name])
    model.save_pretrained(directory, **save_kwargs)
    return directory
