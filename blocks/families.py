"""Model families: which transformers decoder layer runs a block, how the weights are named, and
how positions reach a layer (rotary embeddings or ALiBi). One registry, keyed by config.model_type.

The layer math is transformers' own (Llama-shaped layers run it through blocks.lean's leaner
forward); a family only supplies what the transformers *model* class would have handed each
layer (blocks.layer_inputs) so a span can run layers a..b on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.bloom import modeling_bloom
from transformers.models.falcon import modeling_falcon
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmo2 import modeling_olmo2
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

from blocks import lean
from blocks.errors import CheckpointError, UnsupportedModelError
from blocks.layer_inputs import (
    LayerInputs,
    MaskedInputs,
    RowMasks,
    bloom_inputs,
    bloom_masked,
    causal_mask,
    falcon_inputs,
    falcon_masked,
    inputs_by_kind,
    rotary_inputs,
    rotary_masked,
)

__all__ = ["FAMILIES", "Family", "RowMasks", "causal_mask", "family_of", "prepare_config"]


@dataclass(frozen=True)
class Family:
    name: str
    covers: str  # the models it runs, for people reading errors and docs
    layer_class: type[nn.Module]
    # Weight names, relative to `root` ("model." / "transformer."), which some checkpoints omit.
    root: str
    layer_prefix: str  # formatted with the block index: "layers.{}."
    embed: str  # module path of the token embedding
    final_norm: str
    lm_head: str  # outside root
    embed_norm: str | None  # a norm right after the embedding (bloom)
    attn_implementation: str  # the attention kernel and the mask format that goes with it
    cache_kwarg: str  # the name under which the layer takes its KV cache
    make_norm: Callable[[PretrainedConfig], nn.Module]
    make_rotary: Callable[[PretrainedConfig], nn.Module | None]
    layer_inputs: LayerInputs
    masked_inputs: MaskedInputs
    kv_width: Callable[[PretrainedConfig], int]  # key (= value) features cached per token per layer
    convert_block: Callable[[dict[str, torch.Tensor], PretrainedConfig], dict[str, torch.Tensor]]
    experts_implementation: str | None = None  # mixture-of-experts kernel, as transformers picks
    # Per-layer attention: each layer's kind (config.layer_types); layer_inputs and masked_inputs
    # then give one dict of inputs per kind, and layer i takes its kind's.
    layer_kinds: Callable[[PretrainedConfig], Sequence[str]] | None = None
    # A factor the token embeddings are multiplied by (Gemma: sqrt(hidden_size)).
    embed_scale: Callable[[PretrainedConfig], float] | None = None

    def prefix(self, names: Iterable[str]) -> str:
        """`root` if the checkpoint's names carry it (save_pretrained writes it), else ""."""
        return self.root if any(name.startswith(self.root) for name in names) else ""

    def block_prefix(self, names: Iterable[str], index: int) -> str:
        return self.prefix(names) + self.layer_prefix.format(index)


def _same_names(
    weights: dict[str, torch.Tensor], config: PretrainedConfig
) -> dict[str, torch.Tensor]:
    return weights


def _mixtral_block(
    weights: dict[str, torch.Tensor], config: PretrainedConfig
) -> dict[str, torch.Tensor]:
    """Mixtral checkpoints (hub, and save_pretrained) keep w1/w2/w3 per expert under
    block_sparse_moe; transformers' MixtralDecoderLayer runs fused expert tensors under mlp."""
    if not any(name.startswith("block_sparse_moe.") for name in weights):
        return weights
    converted = {
        name.replace("block_sparse_moe.", "mlp."): tensor
        for name, tensor in weights.items()
        if ".experts." not in name
    }

    def stacked(w: str) -> torch.Tensor:
        experts = range(config.num_local_experts)
        return torch.stack([weights[f"block_sparse_moe.experts.{e}.{w}.weight"] for e in experts])

    # MixtralExperts splits gate_up_proj in halves: gate (w1) first, then up (w3).
    converted["mlp.experts.gate_up_proj"] = torch.cat([stacked("w1"), stacked("w3")], dim=1)
    converted["mlp.experts.down_proj"] = stacked("w2")
    return converted


def _qwen_moe_block(
    weights: dict[str, torch.Tensor], config: PretrainedConfig
) -> dict[str, torch.Tensor]:
    """Qwen2-MoE and Qwen3-MoE checkpoints (hub, and save_pretrained) keep gate/up/down matrices
    per expert under mlp.experts.N; transformers' decoder layer runs them fused: gate_up_proj
    [experts, 2 x intermediate, hidden], gate first, and down_proj [experts, hidden, inter]."""
    if "mlp.experts.0.gate_proj.weight" not in weights:
        return weights  # a dense layer (mlp_only_layers), or experts already fused

    def stacked(w: str) -> torch.Tensor:
        names = [f"mlp.experts.{e}.{w}.weight" for e in range(config.num_experts)]
        missing = [name for name in names if name not in weights]
        if missing:
            raise CheckpointError(
                f"the checkpoint lacks {missing[0]} of a block ({len(missing)} expert matrices "
                f"missing; config.num_experts is {config.num_experts}): re-save the model"
            )
        return torch.stack([weights[name] for name in names])

    converted = {n: t for n, t in weights.items() if not n.startswith("mlp.experts.")}
    converted["mlp.experts.gate_up_proj"] = torch.cat([stacked("gate_proj"), stacked("up_proj")], 1)
    converted["mlp.experts.down_proj"] = stacked("down_proj")
    return converted


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _falcon_kv_heads(config: PretrainedConfig) -> int:
    if config.new_decoder_architecture:
        return config.num_attention_heads  # keys are broadcast to every head before caching
    return 1 if config.multi_query else config.num_kv_heads


def _rotary(module: Callable[[Any], nn.Module]) -> Callable[[PretrainedConfig], nn.Module | None]:
    """The model's rotary embedding module: inverse frequencies from the config, no weights."""
    return lambda config: module(config)


def _layer_norm(config: PretrainedConfig) -> nn.Module:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


LLAMA = Family(
    name="llama",
    covers="Llama 2/3, SmolLM2 and other Llama-shaped models",
    layer_class=lean.LlamaLayer,
    root="model.",
    layer_prefix="layers.{}.",
    embed="embed_tokens",
    final_norm="norm",
    lm_head="lm_head",
    embed_norm=None,
    attn_implementation="sdpa",
    cache_kwarg="cache",
    make_norm=lambda c: modeling_llama.LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps),
    make_rotary=_rotary(modeling_llama.LlamaRotaryEmbedding),
    layer_inputs=rotary_inputs,
    masked_inputs=rotary_masked,
    kv_width=lambda c: c.num_key_value_heads * _head_dim(c),
    convert_block=_same_names,
)

MIXTRAL = Family(
    name="mixtral",
    covers="Mixtral mixture-of-experts models",
    layer_class=modeling_mixtral.MixtralDecoderLayer,
    root="model.",
    layer_prefix="layers.{}.",
    embed="embed_tokens",
    final_norm="norm",
    lm_head="lm_head",
    embed_norm=None,
    attn_implementation="sdpa",
    cache_kwarg="cache",
    make_norm=lambda c: modeling_mixtral.MixtralRMSNorm(c.hidden_size, eps=c.rms_norm_eps),
    make_rotary=_rotary(modeling_mixtral.MixtralRotaryEmbedding),
    layer_inputs=rotary_inputs,
    masked_inputs=rotary_masked,
    kv_width=lambda c: c.num_key_value_heads * _head_dim(c),
    convert_block=_mixtral_block,
    experts_implementation="grouped_mm",
)

BLOOM = Family(
    name="bloom",
    covers="BLOOM models (ALiBi positions)",
    layer_class=modeling_bloom.BloomBlock,
    root="transformer.",
    layer_prefix="h.{}.",
    embed="word_embeddings",
    final_norm="ln_f",
    lm_head="lm_head",
    embed_norm="word_embeddings_layernorm",
    # BloomAttention computes its own scores and adds the mask: it needs eager's additive mask.
    attn_implementation="eager",
    cache_kwarg="layer_past",
    make_norm=_layer_norm,
    make_rotary=lambda c: None,
    layer_inputs=bloom_inputs,
    masked_inputs=bloom_masked,
    kv_width=lambda c: c.hidden_size,
    convert_block=_same_names,
)

FALCON = Family(
    name="falcon",
    covers="Falcon models, rotary or ALiBi (config.alibi)",
    layer_class=modeling_falcon.FalconDecoderLayer,
    root="transformer.",
    layer_prefix="h.{}.",
    embed="word_embeddings",
    final_norm="ln_f",
    lm_head="lm_head",
    embed_norm=None,
    attn_implementation="sdpa",
    cache_kwarg="layer_past",
    make_norm=_layer_norm,
    make_rotary=lambda c: None if c.alibi else _rotary(modeling_falcon.FalconRotaryEmbedding)(c),
    layer_inputs=falcon_inputs,
    masked_inputs=falcon_masked,
    kv_width=lambda c: _falcon_kv_heads(c) * _head_dim(c),
    convert_block=_same_names,
)


def _llama_shaped(
    name: str,
    covers: str,
    layer: type[nn.Module],
    norm: Callable[..., nn.Module],
    rotary: Callable[[Any], nn.Module],
    **differences: Any,
) -> Family:
    """A family laid out as Llama is (model.layers.N, embed_tokens, norm, lm_head; rotary
    positions; sdpa; the cache passed as `cache`): its own classes, and whatever else differs."""
    fields: dict[str, Any] = {
        "name": name,
        "covers": covers,
        "layer_class": layer,
        "root": "model.",
        "layer_prefix": "layers.{}.",
        "embed": "embed_tokens",
        "final_norm": "norm",
        "lm_head": "lm_head",
        "embed_norm": None,
        "attn_implementation": "sdpa",
        "cache_kwarg": "cache",
        "make_norm": lambda c: norm(c.hidden_size, eps=c.rms_norm_eps),
        "make_rotary": _rotary(rotary),
        "layer_inputs": rotary_inputs,
        "masked_inputs": rotary_masked,
        "kv_width": lambda c: c.num_key_value_heads * _head_dim(c),
        "convert_block": _same_names,
    }
    return Family(**{**fields, **differences})


def _layer_types(config: PretrainedConfig) -> Sequence[str]:
    return config.layer_types


def _by_kind(per_kind_rotary: bool = False) -> dict[str, Any]:
    """The Family fields of per-layer attention kinds (sliding or full, config.layer_types)."""
    layer_inputs, masked_inputs = inputs_by_kind(per_kind_rotary)
    return {
        "layer_inputs": layer_inputs,
        "masked_inputs": masked_inputs,
        "layer_kinds": _layer_types,
    }


# Sliding-window layers where config.layer_types says (use_sliding_window / max_window_layers).
QWEN2 = _llama_shaped(
    "qwen2",
    "Qwen2 and Qwen2.5",
    lean.Qwen2Layer,
    modeling_qwen2.Qwen2RMSNorm,
    modeling_qwen2.Qwen2RotaryEmbedding,
    **_by_kind(),
)
QWEN3 = _llama_shaped(
    "qwen3",
    "Qwen3 (dense)",
    modeling_qwen3.Qwen3DecoderLayer,
    modeling_qwen3.Qwen3RMSNorm,
    modeling_qwen3.Qwen3RotaryEmbedding,
    **_by_kind(),
)
QWEN2_MOE = _llama_shaped(
    "qwen2_moe",
    "Qwen2-MoE and Qwen1.5-MoE (routed experts and a shared one)",
    modeling_qwen2_moe.Qwen2MoeDecoderLayer,
    modeling_qwen2_moe.Qwen2MoeRMSNorm,
    modeling_qwen2_moe.Qwen2MoeRotaryEmbedding,
    convert_block=_qwen_moe_block,
    experts_implementation="grouped_mm",
    **_by_kind(),
)
# One sliding window (config.sliding_window) for every layer, or none: as Mistral.
QWEN3_MOE = _llama_shaped(
    "qwen3_moe",
    "Qwen3 mixture-of-experts models",
    modeling_qwen3_moe.Qwen3MoeDecoderLayer,
    modeling_qwen3_moe.Qwen3MoeRMSNorm,
    modeling_qwen3_moe.Qwen3MoeRotaryEmbedding,
    convert_block=_qwen_moe_block,
    experts_implementation="grouped_mm",
)
MISTRAL = _llama_shaped(
    "mistral",
    "Mistral 7B and other Mistral-shaped models (sliding-window attention)",
    lean.MistralLayer,
    modeling_mistral.MistralRMSNorm,
    modeling_mistral.MistralRotaryEmbedding,
)
PHI3 = _llama_shaped(
    "phi3",
    "Phi-3 and Phi-4 (fused projections)",
    modeling_phi3.Phi3DecoderLayer,
    modeling_phi3.Phi3RMSNorm,
    modeling_phi3.Phi3RotaryEmbedding,
)
OLMO2 = _llama_shaped(
    "olmo2",
    "OLMo 2",
    modeling_olmo2.Olmo2DecoderLayer,
    modeling_olmo2.Olmo2RMSNorm,
    modeling_olmo2.Olmo2RotaryEmbedding,
)
# Gemma: sliding and global layers in turn, embeddings scaled by sqrt(hidden), RMSNorm (1 + w).
GEMMA2 = _llama_shaped(
    "gemma2",
    "Gemma 2 (attention and final logit soft-capping)",
    modeling_gemma2.Gemma2DecoderLayer,
    modeling_gemma2.Gemma2RMSNorm,
    modeling_gemma2.Gemma2RotaryEmbedding,
    # sdpa cannot soft-cap attention logits: transformers runs Gemma 2 with eager attention.
    attn_implementation="eager",
    embed_scale=lambda c: c.hidden_size**0.5,
    **_by_kind(),
)
GEMMA3_TEXT = _llama_shaped(
    "gemma3_text",
    "Gemma 3 text models (a local rotary base for sliding layers)",
    modeling_gemma3.Gemma3DecoderLayer,
    modeling_gemma3.Gemma3RMSNorm,
    modeling_gemma3.Gemma3RotaryEmbedding,
    embed_scale=lambda c: c.hidden_size**0.5,
    **_by_kind(per_kind_rotary=True),
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        LLAMA,
        BLOOM,
        FALCON,
        MIXTRAL,
        QWEN2,
        QWEN3,
        QWEN2_MOE,
        QWEN3_MOE,
        MISTRAL,
        PHI3,
        OLMO2,
        GEMMA2,
        GEMMA3_TEXT,
    )
}


def family_of(config: PretrainedConfig) -> Family:
    """The family that runs `config.model_type`; UnsupportedModelError names those there are."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = "; ".join(f"{f.name} ({f.covers})" for f in FAMILIES.values())
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported. peerd runs these families: {supported}. "
        "Use a checkpoint of one of them."
    )


def prepare_config(config: PretrainedConfig, family: Family) -> PretrainedConfig:
    """Set the kernels transformers' own model would pick: the attention kernel the family's masks
    are built for, and the experts kernel (a bare config has neither)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"this {family.name} checkpoint attends both ways (use_bidirectional_attention: an "
            "embedding model); peerd runs causal language models only"
        )
    if family.layer_kinds is not None:
        odd = sorted(set(family.layer_kinds(config)) - {"full_attention", "sliding_attention"})
        if odd:
            raise UnsupportedModelError(
                f"this {family.name} checkpoint has layers of kind {', '.join(odd)} "
                "(config.layer_types); peerd runs full_attention and sliding_attention layers"
            )
    config._attn_implementation = family.attn_implementation
    if family.experts_implementation is not None:
        config._experts_implementation = family.experts_implementation
    return config
