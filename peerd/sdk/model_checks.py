"""What the transformers model checks before it sends anything to the swarm: the generation
modes a remote cache can follow, left padding from an attention mask, prompt tuning settings,
and that the daemon runs the checkpoint loaded here."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from transformers import GenerationConfig, PretrainedConfig
from transformers.generation.configuration_utils import GenerationMode

import blocks
from peerd.sdk.client import Client

# The decoding loops whose cache only ever grows by appending tokens: the only kind a remote
# session can follow.
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
NO_REWIND = (
    "it needs the servers to roll their KV caches back, which the local API does not offer: "
    "use greedy decoding (do_sample=False) or sampling (do_sample=True)"
)
NO_BEAMS = (
    "beam search needs the servers to reorder their KV caches between steps, which the local "
    "API does not offer: use greedy decoding (do_sample=False) or sampling (do_sample=True)"
)

NO_TUNED_SESSIONS = (
    "a prompt-tuned model runs cache-less passes only: inference sessions (and so generate) do "
    "not carry trained prompts yet; evaluate with model(input_ids).logits"
)

NO_TRAINING_ADAPTER = (
    "training passes (prompt tuning, gradients of inputs_embeds) run the servers' base blocks: "
    "they cannot apply a LoRA adapter yet; load the model without active_adapter to tune it"
)


class ModelMismatch(ValueError):
    """The daemon runs another model than the checkpoint this process loaded."""


class UnsupportedGeneration(NotImplementedError):
    """A generation mode that needs more of the servers' caches than appending tokens."""


TuningMode = Literal["ptune", "deep_ptune"]
TUNING_MODES = ("ptune", "deep_ptune")


def left_padding_of(attention_mask: torch.Tensor) -> tuple[int, ...]:
    """Per row, the padding positions at the start of a [batch, tokens] attention mask (zeros,
    then ones, as a tokenizer with padding_side="left" makes); ValueError for any other mask."""
    mask = attention_mask.to("cpu", torch.long)
    if mask.ndim != 2:
        raise ValueError(f"attention_mask must be [batch, tokens], got {list(mask.shape)}")
    padding = (mask == 0).sum(dim=1)
    columns = torch.arange(mask.shape[1])[None]
    if not bool((mask == (columns >= padding[:, None]).long()).all()):
        raise ValueError(
            "attention_mask must hold zeros then ones per row (left padding): the servers skip "
            "a row's first positions only; pad on the left (tokenizer.padding_side = 'left')"
        )
    if bool((padding == mask.shape[1]).any()):
        raise ValueError("a row of attention_mask is all padding: give each row a token")
    return tuple(int(p) for p in padding)


def prompt_length(inputs: torch.Tensor | None, kwargs: dict[str, Any]) -> int:
    if inputs is not None:
        return int(inputs.shape[1])
    if kwargs.get("inputs_embeds") is not None:
        return int(kwargs["inputs_embeds"].shape[1])
    return 1  # generate starts from the BOS token


def batch_size(inputs: torch.Tensor | None, kwargs: dict[str, Any]) -> int:
    if inputs is not None:
        return int(inputs.shape[0])
    if kwargs.get("inputs_embeds") is not None:
        return int(kwargs["inputs_embeds"].shape[0])
    return 1


def check_tuning(tuning_mode: str | None, pre_seq_len: int, adapter: str | None) -> int:
    """pre_seq_len, checked against tuning_mode; ValueError says what to pass."""
    if tuning_mode is not None and adapter is not None:
        raise ValueError(NO_TRAINING_ADAPTER)
    if tuning_mode is None:
        if pre_seq_len:
            raise ValueError("pre_seq_len needs a tuning_mode: 'ptune' or 'deep_ptune'")
        return 0
    if tuning_mode not in TUNING_MODES:
        raise ValueError(f"tuning_mode must be 'ptune' or 'deep_ptune', not {tuning_mode!r}")
    if pre_seq_len < 1:
        raise ValueError(f"tuning_mode {tuning_mode!r} needs pre_seq_len >= 1 prompt positions")
    return pre_seq_len


def check_same_model(client: Client, checkpoint: Path, config: PretrainedConfig) -> None:
    welcome = client.welcome
    ours = blocks.model_name(checkpoint)
    problems = []
    if welcome.model != ours:
        problems.append(f"it runs {welcome.model}, not {ours}")
    if welcome.num_blocks != config.num_hidden_layers:
        problems.append(f"{welcome.num_blocks} blocks, not {config.num_hidden_layers}")
    if welcome.hidden_size != config.hidden_size:
        problems.append(f"hidden size {welcome.hidden_size}, not {config.hidden_size}")
    if problems:
        raise ModelMismatch(
            f"the daemon on {client.path} serves another model than {checkpoint} "
            f"({'; '.join(problems)}): load its model instead, or start a daemon for this one "
            f"with `peerd start --model {checkpoint}` (and --socket to run it beside the first)"
        )


def require_transformers_5() -> None:
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ImportError(
            f"peerd.sdk.model needs transformers 5 or later (its generate hands the KV cache "
            f"to the model as `cache`), not {transformers.__version__}: upgrade transformers"
        )


def generation_config_of(checkpoint: Path) -> GenerationConfig | None:
    """The checkpoint's own generation defaults, when it ships them."""
    if (checkpoint / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(checkpoint, local_files_only=True)
    return None


def new_tokens(
    config: GenerationConfig,
    given: tuple[GenerationConfig | None, GenerationConfig | None],
    kwargs: dict[str, Any],
    prompt: int,
) -> int:
    """How many tokens generate may add, resolved the way transformers does: `config` is what
    generate will use, `given` the generation_config passed to the call and the model's own."""
    if config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    max_length_set = any(c is not None and c.max_length is not None for c in given)
    if kwargs.get("max_length") is not None or max_length_set:
        return max(int(config.max_length) - prompt, 0)
    return int(config.max_length)  # transformers' default: that many new tokens


def client_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the client-side model: the experts of a mixture-of-experts family run on
    the servers, so no experts kernel is requested here (transformers refuses a requested one
    for a model class that has no experts, and blocks.prepare_config names one)."""
    if getattr(config, "_experts_implementation", None) is None:
        return config
    config = copy.deepcopy(config)
    config._experts_implementation = None
    return config
