"""What a transformers model class hands each decoder layer besides hidden states and the KV cache:
masks, positions, rotary embeddings, ALiBi. A span runs layers a..b on their own, so it builds
these itself, for one sequence (layer_inputs) or for rows that differ in past length and left
padding (masked_inputs, from RowMasks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.models.bloom import modeling_bloom
from transformers.models.falcon import modeling_falcon

# What a family gives a layer besides hidden states and the KV cache: masks, positions, ALiBi.
LayerInputs = Callable[[PretrainedConfig, nn.Module | None, torch.Tensor, int], dict[str, Any]]
# The same for rows of one forward that differ in past length and left padding (see RowMasks).
MaskedInputs = Callable[
    [PretrainedConfig, nn.Module | None, torch.Tensor, "RowMasks"], dict[str, Any]
]


@dataclass(frozen=True)
class RowMasks:
    """Where each row of a forward stands, for rows with their own past lengths and padding.

    `allowed[r, 0, q, k]`: query q of row r may attend to key k (causal, not padding, within the
    sliding window; a query always sees its own key, so a padding query never attends to nothing
    and never turns into NaN). `position_ids[r, q]`: its position counted without the row's
    padding. `key_valid[r, k]`: key k of row r is a real token (ALiBi counts those).
    """

    allowed: torch.Tensor  # bool [rows, 1, queries, keys]
    position_ids: torch.Tensor  # long [rows, queries]
    key_valid: torch.Tensor  # bool [rows, keys]
    absolute: torch.Tensor  # long [rows, queries]: each query's position, padding included

    @staticmethod
    def build(
        past: torch.Tensor, pads: torch.Tensor, queries: int, keys: int, window: int | None
    ) -> RowMasks:
        """Masks for rows whose new tokens start at `past[r]` (absolute, padding included) and
        whose first `pads[r]` positions are left padding."""
        absolute = past[:, None] + torch.arange(queries, device=past.device)[None]  # [rows, q]
        key = torch.arange(keys, device=past.device)[None, None]  # [1, 1, k]
        at = absolute[..., None]
        allowed = (key <= at) & (key >= pads[:, None, None]) | (key == at)
        masks = RowMasks(
            allowed=allowed[:, None],
            position_ids=(absolute - pads[:, None]).clamp(min=0),
            key_valid=key[0] >= pads[:, None],
            absolute=absolute,
        )
        return masks if window is None else replace(masks, allowed=masks.within(window))

    def within(self, window: int | None) -> torch.Tensor:
        """`allowed`, narrowed to the last `window` keys of each query (None: as it is), for a
        sliding-window layer. transformers counts the window over absolute positions."""
        if window is None:
            return self.allowed
        key = torch.arange(self.allowed.shape[-1], device=self.allowed.device)[None, None]
        at = self.absolute[..., None]
        allowed = self.allowed[:, 0] & (key > at - window) | (key == at)
        return allowed[:, None]


def causal_mask(
    config: PretrainedConfig,
    hidden_states: torch.Tensor,
    past_length: int,
    *,
    allow_skip: bool = True,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """The mask transformers' own model would build for `q` new tokens after `past_length` cached
    ones, in the format of config._attn_implementation (None: let sdpa use is_causal)."""
    batch_size, q_length = hidden_states.shape[:2]
    mask_function = (
        causal_mask_function
        if sliding_window is None
        else sliding_window_causal_mask_function(sliding_window)
    )
    return ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation](
        batch_size=batch_size,
        q_length=q_length,
        kv_length=past_length + q_length,
        q_offset=past_length,
        kv_offset=0,
        mask_function=mask_function,
        attention_mask=None,
        allow_is_causal_skip=allow_skip,
        local_size=sliding_window,
        dtype=hidden_states.dtype,
        config=config,
        use_vmap=False,
        device=hidden_states.device,
    )


def _positions(hidden_states: torch.Tensor, past_length: int) -> torch.Tensor:
    q_length = hidden_states.shape[1]
    return torch.arange(past_length, past_length + q_length, device=hidden_states.device)[None]


def rotary_inputs(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, past: int
) -> dict[str, Any]:
    assert rotary is not None
    positions = _positions(hidden, past)
    window = getattr(config, "sliding_window", None)
    return {
        "attention_mask": causal_mask(config, hidden, past, sliding_window=window),
        "position_ids": positions,
        "position_embeddings": rotary(hidden, positions),
    }


def bloom_inputs(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, past: int
) -> dict[str, Any]:
    batch_size, q_length = hidden.shape[:2]
    no_padding = torch.ones(batch_size, past + q_length, dtype=torch.long, device=hidden.device)
    return {
        "alibi": modeling_bloom.build_alibi_tensor(no_padding, config.n_head, hidden.dtype),
        "attention_mask": causal_mask(config, hidden, past),
    }


def falcon_inputs(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, past: int
) -> dict[str, Any]:
    positions = _positions(hidden, past)
    # FalconModel always materialises the mask, so the ALiBi bias can be folded into it.
    mask = causal_mask(config, hidden, past, allow_skip=False)
    assert mask is not None
    if not config.alibi:
        assert rotary is not None
        return {
            "alibi": None,
            "attention_mask": mask,
            "position_ids": positions,
            "position_embeddings": rotary(hidden, positions),
        }
    batch_size, q_length = hidden.shape[:2]
    kv_length = past + q_length
    no_padding = torch.ones(batch_size, kv_length, dtype=torch.long, device=hidden.device)
    heads = config.num_attention_heads
    alibi = modeling_falcon.build_alibi_tensor(no_padding, heads, hidden.dtype)
    lowest = torch.finfo(hidden.dtype).min
    if mask.dtype == torch.bool:
        mask = torch.where(mask, torch.zeros((), dtype=hidden.dtype, device=mask.device), lowest)
    scale = math.sqrt(config.hidden_size // heads)
    bias = alibi.reshape(batch_size, heads, 1, kv_length) / scale
    return {
        "alibi": alibi,
        "attention_mask": torch.masked_fill(bias, mask < -1, lowest),
        "position_ids": positions,
        "position_embeddings": None,
    }


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive float mask eager attention adds to its scores."""
    lowest = torch.finfo(dtype).min
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), lowest)


def rotary_masked(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, rows: RowMasks
) -> dict[str, Any]:
    assert rotary is not None
    return {
        "attention_mask": rows.allowed,  # sdpa takes the boolean mask as it is
        "position_ids": rows.position_ids,
        "position_embeddings": rotary(hidden, rows.position_ids),
    }


def bloom_masked(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, rows: RowMasks
) -> dict[str, Any]:
    return {
        "alibi": modeling_bloom.build_alibi_tensor(
            rows.key_valid.long(), config.n_head, hidden.dtype
        ),
        "attention_mask": _additive(rows.allowed, hidden.dtype),
    }


def falcon_masked(
    config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, rows: RowMasks
) -> dict[str, Any]:
    if not config.alibi:
        assert rotary is not None
        return {
            "alibi": None,
            "attention_mask": rows.allowed,
            "position_ids": rows.position_ids,
            "position_embeddings": rotary(hidden, rows.position_ids),
        }
    batch_size, kv_length = rows.key_valid.shape
    heads = config.num_attention_heads
    alibi = modeling_falcon.build_alibi_tensor(rows.key_valid.long(), heads, hidden.dtype)
    scale = math.sqrt(config.hidden_size // heads)
    bias = alibi.reshape(batch_size, heads, 1, kv_length) / scale
    return {
        "alibi": alibi,
        "attention_mask": torch.masked_fill(bias, ~rows.allowed, torch.finfo(hidden.dtype).min),
        "position_ids": rows.position_ids,
        "position_embeddings": None,
    }


# Per-layer attention (config.layer_types: Gemma 2/3, Qwen2 with sliding layers): the inputs of
# every kind of layer there is, keyed by kind; Family.layer_kinds says which kind each layer is.


def _window(config: PretrainedConfig, kind: str) -> int | None:
    return config.sliding_window if kind == "sliding_attention" else None


def _rotate(
    rotary: nn.Module | None, hidden: torch.Tensor, positions: torch.Tensor, kind: str, local: bool
) -> Any:
    assert rotary is not None
    # Gemma 3 keeps one rotary base per kind of layer (a local one for sliding layers).
    return rotary(hidden, positions, kind) if local else rotary(hidden, positions)


def inputs_by_kind(per_kind_rotary: bool = False) -> tuple[LayerInputs, MaskedInputs]:
    """layer_inputs and masked_inputs of a family whose layers differ in attention kind: each
    kind gets the mask (sliding or full) and rotary embedding transformers' model gives it."""

    def layer_inputs(
        config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, past: int
    ) -> dict[str, Any]:
        positions = _positions(hidden, past)
        return {
            kind: {
                "attention_mask": causal_mask(
                    config, hidden, past, sliding_window=_window(config, kind)
                ),
                "position_ids": positions,
                "position_embeddings": _rotate(rotary, hidden, positions, kind, per_kind_rotary),
            }
            for kind in set(config.layer_types)
        }

    def masked_inputs(
        config: PretrainedConfig, rotary: nn.Module | None, hidden: torch.Tensor, rows: RowMasks
    ) -> dict[str, Any]:
        eager = config._attn_implementation == "eager"  # eager adds the mask to its scores
        inputs = {}
        for kind in set(config.layer_types):
            allowed = rows.within(_window(config, kind))
            inputs[kind] = {
                "attention_mask": _additive(allowed, hidden.dtype) if eager else allowed,
                "position_ids": rows.position_ids,
                "position_embeddings": _rotate(
                    rotary, hidden, rows.position_ids, kind, per_kind_rotary
                ),
            }
        return inputs

    return layer_inputs, masked_inputs
