"""Weight quantization of served blocks with bitsandbytes, as Petals does: LLM.int8 (int8 rows
with one float32 scale each, outlier features above `INT8_THRESHOLD` in the serving dtype) or NF4
(4-bit normal-float codes, blocks of 64 weights with double-quantized absmax scales).

Every nn.Linear of a block is replaced by its bitsandbytes twin, which is still an nn.Linear, so
LoRA adapters (blocks.lora) wrap it as they wrap a plain one and add their product in the serving
dtype. Fused mixture-of-experts modules (Mixtral's, Qwen2-MoE's and Qwen3-MoE's experts are 3-D
parameters, not nn.Linear modules, and they are most of such a block) become QuantizedExperts:
one bitsandbytes linear per expert and projection, routed as transformers routes them. Norms,
biases, routers and rotary buffers stay in the serving dtype. `quantized_bytes` and
`experts_bytes` predict what the quantized layers hold, so blocks.memory.block_bytes sizes
`--blocks auto` without building one. docs/blocks.md says why bitsandbytes and not torchao.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

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
    int8 or nf4 layer computing in `dtype` on `device`, and every fused experts module by
    QuantizedExperts; the float weights are freed."""
    if quant == "none":
        return layer
    if quant not in ("int8", "nf4"):
        raise ValueError(f"quant {quant!r}: expected none, int8 or nf4")
    targets = [
        (name, m) for name, m in layer.named_modules() if type(m) is nn.Linear or fused_experts(m)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        if fused_experts(module):
            setattr(parent, child, QuantizedExperts(module, quant, dtype, device))
        else:
            assert isinstance(module, nn.Linear)
            weight, bias = module.weight.data, module.bias
            setattr(parent, child, _quantized(weight, bias, quant, dtype, device))
    return layer


def fused_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts module in the layout QuantizedExperts follows:
    gate_up_proj [experts, 2 x intermediate, hidden] (gate rows, then up rows) and down_proj
    [experts, hidden, intermediate], no biases (MixtralExperts, Qwen2MoeExperts,
    Qwen3MoeExperts). An experts module laid out otherwise is left as it is, and block_bytes
    counts it unquantized by this same test."""
    gate_up, down = _experts_weights(module)
    if gate_up is None or down is None:
        return False
    # The flags transformers' use_experts_implementation sets; absent, the eager layout holds.
    layout = {"is_concatenated": True, "has_gate": True, "is_transposed": False, "has_bias": False}
    return (
        gate_up.dim() == down.dim() == 3
        and all(getattr(module, flag, value) == value for flag, value in layout.items())
        and hasattr(module, "act_fn")
    )


def _experts_weights(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`module`'s gate_up_proj and down_proj parameters, None where it has no such parameter."""
    found = (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None))
    gate_up, down = (p if isinstance(p, nn.Parameter) else None for p in found)
    return gate_up, down


class QuantizedExperts(nn.Module):
    """A fused experts module whose experts each hold their gate-and-up and down projections as
    bitsandbytes linear layers. Its forward is transformers' eager MixtralExperts.forward (the
    same in Qwen2-MoE and Qwen3-MoE) with each expert's matrices replaced by its layers: a token
    goes to each expert the router chose for it, that expert's output is scaled by the router's
    weight for it, and the outputs are summed per token."""

    def __init__(self, experts: nn.Module, quant: str, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        gate_up, down = _experts_weights(experts)
        assert gate_up is not None and down is not None, "not a fused experts module"
        self.num_experts = int(gate_up.shape[0])
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = experts.act_fn  # type: ignore[assignment]
        self.gate_up = nn.ModuleList(_quantized(w, None, quant, dtype, device) for w in gate_up)
        self.down = nn.ModuleList(_quantized(w, None, quant, dtype, device) for w in down)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """`hidden_states` [tokens, hidden]; `top_k_index` and `top_k_weights` [tokens, k]: the
        experts the router chose for each token and their weights."""
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [experts + 1, k, tokens]: which tokens chose each expert, in which of their k
            # places; index num_experts is transformers' "no expert" (expert parallelism).
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            mask = mask.permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit[:, 0].tolist():
            if expert == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert])
            gate, up = self.gate_up[expert](hidden_states[token_idx]).chunk(2, dim=-1)
            out = self.down[expert](self.act_fn(gate) * up)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


def _quantized(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quant: str,
    dtype: torch.dtype,
    device: str,
) -> nn.Module:
    """The bitsandbytes `quant` layer computing `weight` [out, in] (and `bias`) in `dtype`."""
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    weight = weight.to("cpu")  # quantized on the way to `device`
    module: nn.Module
    if quant == "int8":
        module = bnb.nn.Linear8bitLt(
            in_features,
            out_features,
            bias=bias is not None,
            has_fp16_weights=False,
            threshold=INT8_THRESHOLD,
            device="meta",
        )
        module.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    elif quant == "nf4":
        module = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=bias is not None,
            compute_dtype=dtype,
            quant_type="nf4",
            device="meta",
        )
        module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
    else:
        raise ValueError(f"quant {quant!r}: expected none, int8 or nf4")
    if bias is not None:
        module.bias = nn.Parameter(bias.data.to("cpu", dtype), requires_grad=False)
    return module.to(device)


def quantized_bytes(linear: nn.Linear, quant: str, dtype: torch.dtype) -> int:
    """Bytes a `quant` twin of `linear` (which may live on the meta device) holds: its codes,
    its scales and its bias (in `dtype`)."""
    bias = linear.out_features * _size(dtype) if linear.bias is not None else 0
    return _codes_bytes(linear.out_features, linear.in_features, quant) + bias


def experts_bytes(experts: nn.Module, quant: str) -> int:
    """Bytes the QuantizedExperts made of `experts` (a fused_experts module, which may live on
    the meta device) holds: a `quant` layer per expert and projection, without biases."""
    gate_up, down = _experts_weights(experts)
    assert gate_up is not None and down is not None, "not a fused experts module"
    count, double_inter, hidden = gate_up.shape
    per_expert = _codes_bytes(double_inter, hidden, quant)
    per_expert += _codes_bytes(down.shape[1], down.shape[2], quant)
    return count * per_expert


def _codes_bytes(out_features: int, in_features: int, quant: str) -> int:
    """Codes and scales of an [out, in] weight quantized as `quant`."""
    numel = in_features * out_features
    if quant == "int8":
        return numel + 4 * out_features  # int8 codes, one float32 scale per row
    if quant == "nf4":
        scales = math.ceil(numel / NF4_BLOCK)  # uint8 absmax each, after double quantization
        nested = 4 * math.ceil(scales / NF4_NESTED_BLOCK)
        return math.ceil(numel / 2) + scales + nested
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
    for layer in module.modules():  # after its first forward, Linear8bitLt keeps SCB here
        count(getattr(getattr(layer, "state", None), "SCB", None))
    return sum(seen.values())


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
