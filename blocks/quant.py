"""Weight quantization of served blocks with bitsandbytes, as Petals does: LLM.int8 (int8 rows
with one float32 scale each, outlier features above `INT8_THRESHOLD` in the serving dtype) or NF4
(4-bit normal-float codes, blocks of 64 weights with double-quantized absmax scales).

Every nn.Linear of a block is replaced by its bitsandbytes twin, which is still an nn.Linear, so
LoRA adapters (blocks.lora) wrap it as they wrap a plain one and add their product in the serving
dtype. Norms, biases, rotary buffers and fused mixture-of-experts tensors (Mixtral's experts are
parameters, not nn.Linear modules) stay in the serving dtype. `quantized_bytes` predicts what a
quantized linear layer holds, so blocks.memory.block_bytes sizes `--blocks auto` without building
one. docs/blocks.md says why bitsandbytes and not torchao, with the figures.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

INT8_THRESHOLD = 6.0  # LLM.int8's outlier threshold, bitsandbytes' and Petals' default
NF4_BLOCK = 64  # weights per absmax scale in bitsandbytes' 4-bit quantization
NF4_NESTED_BLOCK = 256  # absmax scales per float32 scale of the double quantization


class _QuietCasts(logging.Filter):
    """LLM.int8 computes in float16 whatever the input dtype and logs so at every call of every
    layer (thousands of lines a second on a busy server); the choice is documented instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("MatMul8bitLt: inputs will be cast")


logging.getLogger("bitsandbytes.autograd._functions").addFilter(_QuietCasts())


def quantize_linears(layer: nn.Module, quant: str, dtype: torch.dtype, device: str) -> nn.Module:
    """Replace every nn.Linear of `layer` (its weights real, in `dtype`) by a bitsandbytes
    int8 or nf4 layer computing in `dtype` on `device`; the float weights are freed."""
    if quant == "none":
        return layer
    targets = [(name, m) for name, m in layer.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, child, _quantized(linear, quant, dtype, device))
    return layer


def _quantized(linear: nn.Linear, quant: str, dtype: torch.dtype, device: str) -> nn.Module:
    import bitsandbytes as bnb

    has_bias = linear.bias is not None
    weight = linear.weight.data.to("cpu")  # quantized on the way to `device`
    module: nn.Module
    if quant == "int8":
        module = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            has_fp16_weights=False,
            threshold=INT8_THRESHOLD,
            device="meta",
        )
        module.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    elif quant == "nf4":
        module = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            compute_dtype=dtype,
            quant_type="nf4",
            device="meta",
        )
        module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
    else:
        raise ValueError(f"quant {quant!r}: expected none, int8 or nf4")
    if has_bias:
        assert linear.bias is not None
        module.bias = nn.Parameter(linear.bias.data.to("cpu", dtype), requires_grad=False)
    return module.to(device)


def quantized_bytes(linear: nn.Linear, quant: str, dtype: torch.dtype) -> int:
    """Bytes a `quant` twin of `linear` (which may live on the meta device) holds: its codes,
    its scales and its bias (in `dtype`)."""
    numel = linear.in_features * linear.out_features
    bias = linear.out_features * _size(dtype) if linear.bias is not None else 0
    if quant == "int8":
        return numel + 4 * linear.out_features + bias  # int8 codes, one float32 scale per row
    if quant == "nf4":
        scales = math.ceil(numel / NF4_BLOCK)  # uint8 absmax each, after double quantization
        nested = 4 * math.ceil(scales / NF4_NESTED_BLOCK)
        return math.ceil(numel / 2) + scales + nested + bias
    raise ValueError(f"quant {quant!r}: expected int8 or nf4")


def held_bytes(module: nn.Module) -> int:
    """Bytes of every distinct tensor storage `module` holds: parameters, buffers, and the
    scales bitsandbytes keeps beside its codes (int8 SCB, nf4 quant_state). A measurement, not
    a prediction: what the block costs in memory once built."""
    seen: dict[int, int] = {}

    def count(tensor: torch.Tensor | None) -> None:
        if tensor is None or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()

    for tensor in (*module.parameters(), *module.buffers()):
        count(tensor)
        count(getattr(tensor, "SCB", None))
        state = getattr(tensor, "quant_state", None)
        while state is not None:
            count(state.absmax)
            count(getattr(state, "offset", None))
            state = getattr(state, "state2", None)
    return sum(seen.values())


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
