"""Memory one transformer block takes, measured from the family's own layer class.

A block is built on the meta device (no memory, no weights read), so whatever the layer holds
counts: every expert of a mixture-of-experts MLP, biases, norms, and buffers kept with it. A
formula of hidden and intermediate sizes would miss what a family adds.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from blocks.families import family_of, prepare_config
from blocks.quant import experts_bytes, fused_experts, quantized_bytes


def block_bytes(config: PretrainedConfig, dtype: torch.dtype, quant: str = "none") -> int:
    """Bytes of one block's parameters and buffers, the parameters in `dtype` (as load_span
    converts them) and the buffers in the dtype the layer makes them with. With `quant` int8 or
    nf4, each nn.Linear counts as its bitsandbytes twin holds it (blocks.quant): codes, scales
    and bias, and so does each expert's projection of a fused experts module (Mixtral's);
    the rest (norms, routers) stays in `dtype`."""
    layer = _meta_block(config)
    quantized: set[int] = set()
    linears = 0
    if quant != "none":
        for module in layer.modules():
            if type(module) is nn.Linear:
                linears += quantized_bytes(module, quant, dtype)
            elif fused_experts(module):
                linears += experts_bytes(module, quant)
            else:
                continue
            quantized.update(id(p) for p in module.parameters())
    rest = sum(p.numel() for p in layer.parameters() if id(p) not in quantized)
    buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
    return linears + rest * _element_size(dtype) + buffers


def cache_bytes_per_block(config: PretrainedConfig, dtype: torch.dtype, cache_tokens: int) -> int:
    """Keys and values of `cache_tokens` positions in one block, in `dtype` (the serving dtype:
    the KV cache is made from the layer's own keys and values, blocks.cache)."""
    width = family_of(config).kv_width(config)
    return 2 * width * cache_tokens * _element_size(dtype)


def _meta_block(config: PretrainedConfig) -> nn.Module:
    """Block 0 of `config`'s family, on the meta device. The config is copied: prepare_config
    sets kernels on it, and the caller's stays as it was."""
    family = family_of(config)
    config = prepare_config(copy.deepcopy(config), family)
    with torch.device("meta"):
        return family.layer_class(config, layer_idx=0)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
