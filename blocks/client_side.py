"""The client side of a model: token embeddings in, final norm and LM head out, and the tokenizer.
Loads no decoder block."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import cached_property, partial
from pathlib import Path

import psutil
import torch
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from blocks.checkpoint import (
    CheckpointTensors,
    GenerationDefaults,
    generation_defaults,
    load_config,
    model_name,
    resolve_checkpoint,
)
from blocks.errors import ModelNotFoundError
from blocks.families import Family, family_of, prepare_config
from blocks.greedy_head import HalfShortlist
from blocks.skinny import CLEARLY_FASTER, columns_product, time_ratio

log = logging.getLogger(__name__)

# Row counts of LM-head passes whose form load_client_side times (a decode step of 1-8 sequences),
# each in HEAD_TUNE_REPS pairs of passes after HEAD_TUNE_WARM (~0.4 s for the default model).
HEAD_ROWS = (1, 2, 4, 8)
HEAD_TUNE_REPS = 5
HEAD_TUNE_WARM = 2
# Row counts whose greedy tokens may come through the half-precision shortlist (blocks.greedy_head:
# torch's CPU float16 product is a fast matrix-vector one; 4 rows took 2x the float32 head), kept
# where tune_greedy finds it clearly faster, and only with this many times the copy's size free.
SHORTLIST_ROWS = (1, 2)
SHORTLIST_ROOM = 4


class ClientSide(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        family: Family,
        embeddings: nn.Embedding,
        embed_norm: nn.Module | None,
        final_norm: nn.Module,
        lm_head: LMHead,
        checkpoint: Path,
    ) -> None:
        super().__init__()
        self.config = config
        self.family = family
        self.embeddings = embeddings
        self.embed_norm = embed_norm
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.checkpoint = checkpoint
        self.model = model_name(checkpoint)
        # Row counts (of HEAD_ROWS) whose CPU LM head runs as nn.Linear does rather than in the
        # columns form (_cpu_lm_head): tune_lm_head's choice; a count between two takes the
        # choice of the one below, and more than the last the columns form.
        self.linear_rows: frozenset[int] = frozenset()
        # The half-precision copy of the head for greedy tokens, and the row counts it serves
        # (tune_greedy's choice; none: every greedy token takes the float32 head).
        self.shortlist: HalfShortlist | None = None
        self.shortlist_rows: frozenset[int] = frozenset()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, tokens] -> the hidden states block 0 takes."""
        hidden = self.embeddings(input_ids.to(self.embeddings.weight.device))
        return self.embed_norm(hidden) if self.embed_norm is not None else hidden

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states after the last block -> vocabulary logits (final norm, then LM head)."""
        weight = self.lm_head.weight
        normed = self.final_norm(hidden_states.to(weight.device, weight.dtype))
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or self._linear_for(normed):
            return self.lm_head(normed)
        return self.lm_head.cap(_cpu_lm_head(normed, weight, self.lm_head.bias))

    def greedy(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states [rows, hidden] after the last block -> each row's greedy token [rows, 1]
        (logits(...).argmax), through the half-precision shortlist where tune_greedy kept it."""
        if self.shortlist is not None and hidden_states.shape[0] in self.shortlist_rows:
            weight = self.lm_head.weight
            tokens = self.shortlist.argmax(
                self.final_norm(hidden_states.to(weight.device, weight.dtype))
            )
            if tokens is not None:
                return tokens[:, None]
        return self.logits(hidden_states).argmax(dim=-1, keepdim=True)

    def _linear_for(self, hidden: torch.Tensor) -> bool:
        rows = hidden.numel() // hidden.shape[-1]
        tuned = [r for r in HEAD_ROWS if r <= rows]
        return rows <= HEAD_ROWS[-1] and bool(tuned) and tuned[-1] in self.linear_rows

    def tune_lm_head(self, timer: Callable[[], float] = time.thread_time) -> frozenset[int]:
        """Time the CPU LM head on HEAD_ROWS rows in both forms, pass by pass in turn (the
        calling thread's CPU time, as blocks.skinny.tune), and keep nn.Linear's where it is
        clearly faster. Which one wins depends on the CPU's BLAS: one machine ran one row of the
        default model's head in 5.8 ms in the columns form against 11.5 with nn.Linear, another
        in 11.5 against 4.8 (two threads); for 8 rows the columns form won on both."""
        weight = self.lm_head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return frozenset()

        best: dict[int, float] = {}
        with torch.inference_mode():
            for rows in HEAD_ROWS:
                hidden = torch.randn(rows, weight.shape[1])
                best[rows] = time_ratio(
                    partial(self.lm_head, hidden),
                    partial(_cpu_lm_head, hidden, weight, self.lm_head.bias),
                    timer,
                    warm=HEAD_TUNE_WARM,
                    reps=HEAD_TUNE_REPS,
                )
        self.linear_rows = frozenset(r for r, ratio in best.items() if ratio <= CLEARLY_FASTER)
        log.info(
            "LM head passes of %s rows as nn.Linear (its time over the columns form's: %s)",
            ",".join(map(str, sorted(self.linear_rows))) or "no",
            ", ".join(f"{rows}: {ratio:.2f}" for rows, ratio in best.items()),
        )
        return self.linear_rows

    def tune_greedy(self, timer: Callable[[], float] = time.thread_time) -> frozenset[int]:
        """Time greedy tokens of SHORTLIST_ROWS rows through a half-precision copy of the head
        (blocks.greedy_head) against the float32 head's tuned form, pass by pass in turn, and keep
        the copy for the row counts where it is clearly faster. Only for a float32 CPU head
        without soft-capping, with SHORTLIST_ROOM times the copy's size free, on a machine whose
        float16 product sums in float32 (the bound relies on it)."""
        weight = self.lm_head.weight
        self.shortlist, self.shortlist_rows = None, frozenset()
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or self.lm_head.softcap:
            return self.shortlist_rows
        copy_bytes = weight.numel() * 2
        if psutil.virtual_memory().available < SHORTLIST_ROOM * copy_bytes:
            log.info("no half-precision LM head: %d MiB of it would not fit", copy_bytes >> 20)
            return self.shortlist_rows
        shortlist = HalfShortlist(weight)
        if not shortlist.kernel_sums_in_float32():
            log.info(
                "no half-precision LM head: this machine's float16 product is not exact enough"
            )
            return self.shortlist_rows
        self.shortlist = shortlist
        ratios: dict[int, float] = {}
        with torch.inference_mode():
            for rows in SHORTLIST_ROWS:
                hidden = torch.randn(rows, weight.shape[1])
                ratios[rows] = time_ratio(  # (no rows kept yet: greedy takes the float32 head)
                    partial(_shortlisted, shortlist, self.final_norm, hidden),
                    partial(self.greedy, hidden),
                    timer,
                    warm=HEAD_TUNE_WARM,
                    reps=HEAD_TUNE_REPS,
                )
        self.shortlist_rows = frozenset(r for r, ratio in ratios.items() if ratio <= CLEARLY_FASTER)
        if not self.shortlist_rows:
            self.shortlist = None
        log.info(
            "greedy tokens of %s rows by a half-precision LM head (its time over float32's: %s)",
            ",".join(map(str, sorted(self.shortlist_rows))) or "no",
            ", ".join(f"{rows}: {ratio:.2f}" for rows, ratio in ratios.items()),
        )
        return self.shortlist_rows

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The checkpoint's tokenizer (with its chat template), loaded on first use."""
        try:
            return AutoTokenizer.from_pretrained(self.checkpoint, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelNotFoundError(
                f"{self.checkpoint} has no usable tokenizer ({e}); save one there with "
                "tokenizer.save_pretrained(dir)"
            ) from e

    @cached_property
    def generation_defaults(self) -> GenerationDefaults:
        """Sampling defaults and end-of-sequence ids from the checkpoint's generation_config.json
        (peerd.session.generation applies them where a request leaves a value unset)."""
        return generation_defaults(self.checkpoint)

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a sequence: the tokenizer's EOS, then any generation_config.json adds
        (Llama 3 Instruct ends a turn with <|eot_id|>, which only its generation config names)."""
        eos = self.tokenizer.eos_token_id
        ids = [] if eos is None else list(eos) if isinstance(eos, list) else [int(eos)]
        return ids + [i for i in self.generation_defaults.eos_token_ids if i not in ids]


class ScaledEmbedding(nn.Embedding):
    """Token embeddings multiplied by a constant (Gemma: sqrt(hidden_size)), the constant rounded
    to the weights' dtype first, as transformers does."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scale, dtype=self.weight.dtype, device=self.weight.device)
        return super().forward(input_ids) * scale


class LMHead(nn.Linear):
    """The LM head, with the final logit soft-capping of the families that have one (Gemma 2:
    config.final_logit_softcapping, logits -> cap * tanh(logits / cap))."""

    def __init__(self, hidden_size: int, vocab_size: int, softcap: float | None) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.softcap = softcap

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.cap(super().forward(hidden_states))

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


def load_client_side(
    checkpoint: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ClientSide:
    """Embeddings, final norm and LM head of `checkpoint`, reading none of the blocks' tensors.

    With tied embeddings (config.tie_word_embeddings, or no lm_head tensor in the checkpoint) the
    LM head shares the embedding matrix.
    """
    path = resolve_checkpoint(checkpoint)
    config = load_config(path)
    family = family_of(config)
    prepare_config(config, family)
    tensors = CheckpointTensors(path)
    root = family.prefix(tensors.file_of)

    def load(module: nn.Module, prefix: str) -> nn.Module:
        names = tensors.names_with_prefix(prefix)
        weights = tensors.read(names, dtype, device)
        module.load_state_dict(
            {name.removeprefix(prefix): t for name, t in weights.items()}, strict=True, assign=True
        )
        return module

    with torch.device("meta"):
        embeddings = _embeddings(config, family)
        final_norm = family.make_norm(config)
        embed_norm = family.make_norm(config) if family.embed_norm else None
        softcap = getattr(config, "final_logit_softcapping", None)
        lm_head = LMHead(config.hidden_size, config.vocab_size, softcap)
    load(embeddings, f"{root}{family.embed}.")
    load(final_norm, f"{root}{family.final_norm}.")
    if embed_norm is not None:
        load(embed_norm, f"{root}{family.embed_norm}.")
    head_weight = f"{family.lm_head}.weight"
    if getattr(config, "tie_word_embeddings", False) or head_weight not in tensors:
        lm_head.weight = embeddings.weight
    else:
        load(lm_head, f"{family.lm_head}.")
    client = ClientSide(config, family, embeddings, embed_norm, final_norm, lm_head, path)
    client.eval()
    client.requires_grad_(False)
    client.tune_lm_head()
    client.tune_greedy()
    return client


def _shortlisted(
    shortlist: HalfShortlist, final_norm: nn.Module, hidden: torch.Tensor
) -> torch.Tensor | None:
    return shortlist.argmax(final_norm(hidden))


def _embeddings(config: PretrainedConfig, family: Family) -> nn.Embedding:
    if family.embed_scale is None:
        return nn.Embedding(config.vocab_size, config.hidden_size)
    return ScaledEmbedding(config.vocab_size, config.hidden_size, family.embed_scale(config))


def _cpu_lm_head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """hidden @ weight.T (+ bias) on a CPU, as weight @ hidden.T with at least two columns.

    The LM head of a decode step is a few rows against a [vocab, hidden] matrix, bound by reading
    that matrix. Asked as hidden @ weight.T, the CPU BLAS takes a slow path for it; as weight @
    hidden.T with two or more columns, it streams the matrix about twice as fast (SmolLM2, fp32,
    one thread: 11.5 ms -> 5.8 ms for one row, 24 -> 15 ms for eight; no slower for long
    prompts). The same sums in another order: logits agree within float rounding.
    """
    logits = columns_product(weight, hidden.reshape(-1, hidden.shape[-1]))
    if bias is not None:
        logits = logits + bias
    return logits.reshape(*hidden.shape[:-1], weight.shape[0])
