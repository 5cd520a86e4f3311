"""Llama-shaped decoder layers with a leaner forward: the same modules, weights and math as
transformers' own layer, in fewer Python calls.

A decode step of a small model is a few dozen tiny products per block, so what runs around them
counts: transformers' layer goes through the attention interface's registry and dispatch, a
rotary helper, two RMSNorm modules of five tensor operations each, and keyword plumbing. A
10-block one-token pass of the default model on the 2-core development machine (2026-12-06, two
torch threads) took 10.9-11.1 ms with transformers' forward and 9.9-10.0 ms with this one, and
13.6-13.7 against 12.4-12.6 ms after 30 ms idle, as a server's pass between two tokens runs.
Petals runs its own Llama block for the same reason.

The forward calls the layer's own projection modules, so what replaces or wraps them (LoRA
adapters, quantized and skinny linear layers) applies unchanged, and it keeps transformers'
order of operations: its outputs are those of the layer it replaces up to float rounding (the
RMSNorm is torch's fused kernel). Only layers whose forward is exactly Llama's are leaned: the
attention (q, k, v, o projections with optional bias, rotary positions, scaled dot-product
attention with grouped keys and values), the pre-norms and the gated MLP. Families whose layers
differ (Qwen3's query and key norms, OLMo 2's post-norms, Phi-3's fused projections, Gemma's
soft-capping) keep transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2


def _norm(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm: normalized in float32, cast back, then scaled by the weight (in
    float32 all three are torch's one fused kernel)."""
    shape, eps = (hidden.shape[-1],), module.variance_epsilon
    if hidden.dtype == torch.float32 and module.weight.dtype == torch.float32:
        return F.rms_norm(hidden, shape, module.weight, eps)
    return module.weight * F.rms_norm(hidden.float(), shape, None, eps).to(hidden.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attend(
    attn: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Scaled dot-product attention as transformers' sdpa integration runs it: grouped keys and
    values shared by sdpa itself where no mask is given (a query of one token, or a whole prompt
    from position 0, causal); with a mask, a one-token query's heads packed per key head, and
    longer queries' keys and values repeated to every query head."""
    dropout = attn.attention_dropout if attn.training else 0.0
    groups = attn.num_key_value_groups
    if mask is None:
        causal = False
        if q.shape[2] > 1:  # (a branch: sdpa takes a bool, not a compiled graph's symbolic one)
            causal = True
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=causal, scale=attn.scaling, enable_gqa=groups > 1
        )
    if groups > 1 and q.shape[2] == 1 and mask.shape[1] == 1:
        # One query a row (merged decode steps): each key head's query heads as its queries,
        # so keys and values are read once, not copied per query head.
        batch, heads, _, width = q.shape
        packed = q.reshape(batch, heads // groups, groups, width)
        out = F.scaled_dot_product_attention(
            packed, k, v, attn_mask=mask, dropout_p=dropout, scale=attn.scaling
        )
        return out.reshape(batch, heads, 1, width)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=attn.scaling
    )


class _LeanForward:
    """The forward of a Llama-shaped layer (see the module's docstring); mixed into a subclass
    of transformers' layer class, so the weights' names, loading and everything else are its."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Any = None,
        **_: Any,
    ) -> torch.Tensor:
        assert position_embeddings is not None, "Llama-shaped layers take rotary positions"
        layer: Any = self  # transformers' layer, whose modules the mixin cannot declare
        attn, mlp = layer.self_attn, layer.mlp
        batch, tokens = hidden_states.shape[:2]
        shape = (batch, tokens, -1, attn.head_dim)
        x = _norm(layer.input_layernorm, hidden_states)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx)
        out = _attend(attn, q, k, v, attention_mask)
        hidden = hidden_states + attn.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))
        x = _norm(layer.post_attention_layernorm, hidden)
        return hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


class LlamaLayer(_LeanForward, modeling_llama.LlamaDecoderLayer):
    pass


class MistralLayer(_LeanForward, modeling_mistral.MistralDecoderLayer):
    pass


class Qwen2Layer(_LeanForward, modeling_qwen2.Qwen2DecoderLayer):
    pass
