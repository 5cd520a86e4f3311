"""A span: decoder blocks start..end-1 of a model, loaded alone from the checkpoint and run with a
per-session KV cache (inference) or without one (training-style full passes, autograd-friendly)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from blocks import skinny, threads
from blocks.cache import KVCache, SpanSession
from blocks.checkpoint import CheckpointTensors, load_config, model_name, resolve_checkpoint
from blocks.compiled import CompiledPasses, compile_span
from blocks.families import Family, RowMasks, family_of, prepare_config
from blocks.lora import AdapterError, AdapterInfo, attach_adapter, read_adapter, use_adapter
from blocks.quant import held_bytes, quantize_linears
from wire.peer_protocol import check_prompts

# Prompts longer than this go through the span in pieces, so activation memory stays bounded.
PREFILL_CHUNK_TOKENS = 512


class Span(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        family: Family,
        start: int,
        layers: list[nn.Module],
        rotary: nn.Module | None,
        model: str,
        adapters: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.config = config
        self.family = family
        self.start = start
        self.end = start + len(layers)
        self.model = model  # model_name() of the checkpoint, for DHT keys and probe caches
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary
        self.chunk_tokens = PREFILL_CHUNK_TOKENS
        self.adapters = adapters  # LoRA adapters a forward may name (blocks.lora)
        self.compiled: CompiledPasses | None = None  # compile_passes's, once it ran

    @property
    def skinny_rows(self) -> frozenset[int]:
        """The row counts its passes compute in skinny form (blocks.skinny; load_span tunes
        them), as its linear layers hold them."""
        return next((m.skinny_rows for m in self._skinny_linears()), frozenset())

    @skinny_rows.setter
    def skinny_rows(self, rows: frozenset[int]) -> None:
        skinny.set_rows(self._skinny_linears(), rows)

    def _skinny_linears(self) -> list[skinny.SkinnyLinear]:
        return [m for m in self.modules() if isinstance(m, skinny.SkinnyLinear)]

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def dtype(self) -> torch.dtype:
        """The serving dtype: activations, KV cache and unquantized weights (a quantized span's
        linear weights are int8 or packed 4-bit codes, so the first floating parameter says)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    @property
    def quant(self) -> str:
        """none, int8 or nf4 (blocks.quant): how the linear weights of the blocks are held."""
        for module in self.layers.modules():
            kind = type(module).__name__
            if kind in ("Linear8bitLt", "Linear4bit"):
                return "int8" if kind == "Linear8bitLt" else "nf4"
        return "none"

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token of one sequence takes in this span (keys and values, all blocks),
        to turn a memory budget into MemoryCache tokens."""
        width = self.family.kv_width(self.config)
        return 2 * self.num_blocks * width * torch.finfo(self.dtype).bits // 8

    @property
    def weight_bytes(self) -> int:
        """Bytes the blocks' weights hold, quantization scales included (blocks.quant)."""
        return held_bytes(self.layers)

    def sub_span(self, start: int, end: int) -> Span:
        """Blocks start..end-1 of this span as a Span of their own, sharing the weights (for a
        route that uses part of what a server holds). Sessions are not shared between the two."""
        if not self.start <= start < end <= self.end:
            raise ValueError(
                f"blocks {start}:{end} are not within this span {self.start}:{self.end}"
            )
        layers = list(self.layers)[start - self.start : end - self.start]
        return Span(self.config, self.family, start, layers, self.rotary, self.model, self.adapters)

    def compile_passes(self, packed_room: int | None = None) -> bool:
        """Ready this span for serving, trading memory for speed: packed copies of its weights
        for merged decode steps where tuning finds them faster and they fit `packed_room` bytes
        (blocks.skinny.tune_packed; None: no budget), and its decode steps and prompts' first
        passes compiled (blocks.compiled), if it can run them compiled here; True if it will."""
        linears = self._skinny_linears()
        if linears:
            sample = self._tuning_sample()
            skinny.tune_packed(sample, self.config.hidden_size, linears, room=packed_room)
        self.compiled = compile_span(self)
        return self.compiled is not None

    def _tuning_sample(self) -> Span:
        """The span's first blocks (blocks.skinny.TUNE_BLOCKS), timed in its tunings: their
        weights still far larger than a CPU's caches, so a long span tunes no slower than a
        short one."""
        layers = list(self.layers)[: skinny.TUNE_BLOCKS]
        return Span(self.config, self.family, self.start, layers, self.rotary, self.model)

    def add_adapter(self, adapter: AdapterInfo) -> None:
        """Load the LoRA matrices of this span's blocks from `adapter` and offer it by name."""
        if adapter.name in self.adapters:
            raise AdapterError(f"this span already has an adapter named {adapter.name!r}")
        attach_adapter(list(self.layers), self.start, adapter, self.family)
        self.compiled = None  # the graph has no adapters in it
        self.adapters = (*self.adapters, adapter.name)

    def forward(
        self,
        hidden_states: torch.Tensor,
        session: SpanSession | None = None,
        adapter: str | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [batch, tokens, hidden] -> the same after this span's blocks.

        With a session, the tokens continue its sequence at session.position and their keys and
        values are cached (inference mode, in chunks of chunk_tokens); without one they are a
        whole sequence from position 0, in one piece, and gradients flow back to hidden_states
        and to `prompts`: deep prompts [blocks, batch or 1, prefix, hidden], the one of each
        block added to the first `prefix` positions of that block's input (Petals' deep prompt
        tuning; a batch of 1 is shared by every sequence).
        `adapter` names a LoRA adapter of this span to apply (a session must keep to one).
        """
        self._check_adapter(adapter)
        with use_adapter(adapter):
            return self._forward(hidden_states, session, prompts)

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.adapters:
            offered = ", ".join(self.adapters) or "none"
            raise AdapterError(
                f"this span has no adapter {adapter!r} (it has: {offered}); load it with "
                "`peerd start --adapters DIR`"
            )

    def _forward(
        self,
        hidden_states: torch.Tensor,
        session: SpanSession | None,
        prompts: torch.Tensor | None,
    ) -> torch.Tensor:
        hidden_states = hidden_states.to(device=self.device, dtype=self.dtype)
        if session is None:
            if prompts is not None:
                check_prompts(prompts, hidden_states, self.num_blocks)
                prompts = prompts.to(device=self.device, dtype=self.dtype)
            return self._run_blocks(hidden_states, None, past_length=0, prompts=prompts)
        if prompts is not None:
            raise ValueError("deep prompts go with cache-less passes only, not a session's steps")
        if session.padded:
            return self._forward_batch([(hidden_states, session)])[0]
        batch_size, new_tokens = hidden_states.shape[:2]
        if batch_size != session.batch_size:
            raise ValueError(
                f"hidden_states hold {batch_size} sequences; the session was opened for "
                f"{session.batch_size}"
            )
        span_key = (id(self), self.start, self.end)
        kv = session.acquire(span_key, self.start, self.num_blocks, new_tokens)
        position = kv.length
        try:
            outputs = []
            # Inference mode always, whatever the caller's mode: the cache's tensors are created
            # in the first call and written in every later one, which must agree.
            with torch.inference_mode():
                for chunk in hidden_states.split(self.chunk_tokens, dim=1):
                    outputs.append(self._run_blocks(chunk, kv, past_length=kv.length))
                    kv.length += chunk.shape[1]
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        except BaseException:
            kv.length = position  # all or nothing: a failed call leaves the session as it was
            raise
        finally:
            session.release()

    def forward_batch(
        self, steps: Sequence[tuple[torch.Tensor, SpanSession]], adapter: str | None = None
    ) -> list[torch.Tensor]:
        """Steps of several sessions in one forward: each hidden_states [batch_i, tokens_i, hidden]
        continues its own session, whatever its past length and left padding, and its output is
        what span(hidden_states_i, session_i, adapter) alone would give (up to float rounding).

        Rows are stacked, shorter steps padded, and every row attends to its own cache only, so a
        server merges concurrent decode steps of its clients into one pass over its weights.
        """
        self._check_adapter(adapter)
        with use_adapter(adapter):
            return self._forward_batch(steps)

    def _forward_batch(
        self, steps: Sequence[tuple[torch.Tensor, SpanSession]]
    ) -> list[torch.Tensor]:
        kvs: list[KVCache] = []
        acquired: list[SpanSession] = []
        span_key = (id(self), self.start, self.end)
        try:
            for hidden, session in steps:
                if hidden.shape[0] != session.batch_size:
                    raise ValueError(
                        f"hidden_states hold {hidden.shape[0]} sequences; the session was opened "
                        f"for {session.batch_size}"
                    )
                kvs.append(session.acquire(span_key, self.start, self.num_blocks, hidden.shape[1]))
                acquired.append(session)
        except BaseException:
            for session in acquired:
                session.release()
            raise
        positions = [kv.length for kv in kvs]
        inputs = [h.to(device=self.device, dtype=self.dtype) for h, _ in steps]
        outputs: list[list[torch.Tensor]] = [[] for _ in steps]
        try:
            with torch.inference_mode():
                longest = max(h.shape[1] for h in inputs)
                for begin in range(0, longest, self.chunk_tokens):
                    live = [i for i, h in enumerate(inputs) if h.shape[1] > begin]
                    chunk = [inputs[i][:, begin : begin + self.chunk_tokens] for i in live]
                    parts = [
                        (h, kvs[i], steps[i][1].left_padding)
                        for h, i in zip(chunk, live, strict=True)
                    ]
                    for i, out in zip(live, self._run_rows(parts), strict=True):
                        outputs[i].append(out)
            return [out[0] if len(out) == 1 else torch.cat(out, dim=1) for out in outputs]
        except BaseException:
            for kv, position in zip(kvs, positions, strict=True):
                kv.length = position
            raise
        finally:
            for session in acquired:
                session.release()

    def _run_rows(
        self, parts: list[tuple[torch.Tensor, KVCache, tuple[int, ...]]]
    ) -> list[torch.Tensor]:
        """One pass of stacked rows (see forward_batch); advances each part's cache."""
        queries = max(h.shape[1] for h, _, _ in parts)
        keys = max(kv.length + h.shape[1] for h, kv, _ in parts)
        # As for one session's pass: else a merged pass ran with the count the last single
        # pass left (a prompt's every core for 8 merged decode steps, after a prefill).
        threads.apply(sum(h.shape[0] for h, _, _ in parts) * queries)
        if len(parts) == 1:
            hidden = parts[0][0]
        else:
            first = parts[0][0]
            rows = sum(h.shape[0] for h, _, _ in parts)
            hidden = first.new_zeros(rows, queries, first.shape[2])
            row = 0
            for h, _, _ in parts:
                hidden[row : row + h.shape[0], : h.shape[1]] = h
                row += h.shape[0]
        past = torch.tensor([kv.length for h, kv, _ in parts for _ in range(h.shape[0])])
        if self.compiled is not None and all(
            h.shape[:2] == (1, 1) and not any(padding) for h, _, padding in parts
        ):
            # The merged steps' graph builds its own masks: it takes only the rows' positions.
            positions = past[:, None].to(self.device)
            merged = self.compiled.run_merged(hidden, [kv for _, kv, _ in parts], positions)
            if merged is not None:
                for _, kv, _ in parts:
                    kv.length += 1
                return list(merged.split(1))
        pads = torch.tensor([pad for _, _, padding in parts for pad in padding])
        # Layers of several kinds narrow the masks to their own window (family.masked_inputs).
        uniform = self.family.layer_kinds is None
        window = getattr(self.config, "sliding_window", None) if uniform else None
        masks = RowMasks.build(past.to(self.device), pads.to(self.device), queries, keys, window)
        inputs = self.family.masked_inputs(self.config, self.rotary, hidden, masks)
        cache = {
            self.family.cache_kwarg: _RowsKV(
                [(kv, h.shape[0], h.shape[1]) for h, kv, _ in parts], keys
            )
        }
        for index, layer in enumerate(self.layers):
            output = layer(hidden, **self._inputs_of(inputs, index), **cache)
            hidden = output[0] if isinstance(output, tuple) else output
        outputs = []
        row = 0
        for h, kv, _ in parts:
            outputs.append(hidden[row : row + h.shape[0], : h.shape[1]])
            row += h.shape[0]
            kv.length += h.shape[1]
        return outputs

    def _run_blocks(
        self,
        hidden: torch.Tensor,
        kv: KVCache | None,
        past_length: int,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        threads.apply(hidden.shape[0] * hidden.shape[1])  # prefill wants more cores than decode
        inputs = self.family.layer_inputs(self.config, self.rotary, hidden, past_length)
        if self.compiled is not None and kv is not None and prompts is None:
            output = self.compiled(hidden, kv, inputs)
            if output is not None:
                return output
        cache = {self.family.cache_kwarg: kv}
        for index, layer in enumerate(self.layers):
            if prompts is not None:
                prefix = prompts.shape[2]
                # Out of place, so autograd sees the addition (and the caller's tensor is kept).
                hidden = torch.cat([hidden[:, :prefix] + prompts[index], hidden[:, prefix:]], 1)
            output = layer(hidden, **self._inputs_of(inputs, index), **cache)
            # Llama-style layers return the hidden states; bloom/falcon (hidden, attentions).
            hidden = output[0] if isinstance(output, tuple) else output
        return hidden

    def _inputs_of(self, inputs: dict[str, Any], index: int) -> dict[str, Any]:
        """What layer `index` of this span takes: the inputs every layer shares, or, in a family
        of sliding and full layers, those of the layer's kind."""
        kinds = self.family.layer_kinds
        return inputs if kinds is None else inputs[kinds(self.config)[self.start + index]]

    def extra_repr(self) -> str:
        return f"model={self.model!r}, blocks={self.start}:{self.end}, family={self.family.name}"


class _RowsKV:
    """The cache the layers see in a forward of several sessions' rows: each part's new keys and
    values go into its own session's cache, and attention gets every part's, padded to one width
    (the masks hide the padding)."""

    def __init__(self, parts: list[tuple[KVCache, int, int]], keys: int) -> None:
        self.parts = parts  # (cache, rows, new tokens) in row order
        self.keys = keys

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.parts) == 1:
            return self.parts[0][0].update(key, value, layer_idx)
        all_keys = key.new_empty(key.shape[0], key.shape[1], self.keys, key.shape[3])
        all_values = value.new_empty(value.shape[0], value.shape[1], self.keys, value.shape[3])
        row = 0
        for kv, rows, tokens in self.parts:
            end = row + rows
            keys, values = kv.update(
                key[row:end, :, :tokens], value[row:end, :, :tokens], layer_idx
            )
            filled = keys.shape[2]
            all_keys[row:end, :, :filled] = keys
            all_values[row:end, :, :filled] = values
            # Zeros past a row's keys: masked out, but a stray NaN there would still reach the
            # output through a zero attention weight (0 * NaN).
            all_keys[row:end, :, filled:] = 0
            all_values[row:end, :, filled:] = 0
            row = end
        return all_keys, all_values


def load_span(
    checkpoint: str | Path,
    start: int,
    end: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    adapters: Sequence[str | Path | AdapterInfo] = (),
    quant: str = "none",
) -> Span:
    """Blocks start..end-1 of `checkpoint` ("default" or a directory), reading only their tensors.

    Layers are built on the meta device and take the tensors read from safetensors as they are
    (assign=True), so memory grows by the span's weights and nothing else. `adapters` are PEFT
    LoRA directories (or their read_adapter infos): only their matrices for these blocks load.
    `quant` int8 or nf4 quantizes each block's linear layers as it loads (blocks.quant), so
    memory peaks at one block in `dtype` beside the quantized others.
    """
    path = resolve_checkpoint(checkpoint)
    config = load_config(path)
    family = family_of(config)
    prepare_config(config, family)
    num_layers = config.num_hidden_layers
    if not 0 <= start < end <= num_layers:
        raise ValueError(
            f"blocks {start}:{end} are not a span of {model_name(path)}, which has blocks "
            f"0:{num_layers}; give 0 <= start < end <= {num_layers}"
        )
    tensors = CheckpointTensors(path)
    layers = []
    for index in range(start, end):
        with torch.device("meta"):
            layer = family.layer_class(config, layer_idx=index)
        prefix = family.block_prefix(tensors.file_of, index)
        # A quantized block is read to the CPU and quantized on its way to `device`.
        read_to = device if quant == "none" else "cpu"
        weights = tensors.read(tensors.names_with_prefix(prefix), dtype, read_to)
        weights = {name.removeprefix(prefix): tensor for name, tensor in weights.items()}
        layer.load_state_dict(family.convert_block(weights, config), strict=True, assign=True)
        _check_materialized(layer, f"block {index}")
        layers.append(quantize_linears(layer, quant, dtype, str(device)).to(device))
    rotary = family.make_rotary(config)
    if rotary is not None:
        rotary = rotary.to(device)
    span = Span(config, family, start, layers, rotary, model_name(path))
    span.eval()  # no dropout
    if quant == "none" and dtype == torch.float32 and torch.device(device).type == "cpu":
        skinny.tune(span._tuning_sample(), config.hidden_size, skinny.make_skinny(span))
    for adapter in adapters:
        if not isinstance(adapter, AdapterInfo):
            adapter = read_adapter(adapter, config, family)
        span.add_adapter(adapter)
    # Servers never train the weights; gradients still reach the input hidden states.
    span.requires_grad_(False)
    return span


def _check_materialized(module: nn.Module, what: str) -> None:
    left = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{what}: the checkpoint gave no values for {', '.join(left)}")
