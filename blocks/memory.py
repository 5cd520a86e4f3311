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


def block_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of one block's parameters and buffers, the parameters in `dtype` (as load_span
    converts them) and the buffers in the dtype the layer makes them with."""
    layer = _meta_block(config)
    weights = sum(p.numel() for p in layer.parameters()) * _element_size(dtype)
    buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
    return weights + buffers


def _meta_block(config: PretrainedConfig) -> nn.Module:
    """Block 0 of `config`'s family, on the meta device. The config is copied: prepare_config
    sets kernels on it, and the caller's stays as it was."""
    family = family_of(config)
    config = prepare_config(copy.deepcopy(config), family)
    with torch.device("meta"):
        return family.layer_class(config, layer_idx=0)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
