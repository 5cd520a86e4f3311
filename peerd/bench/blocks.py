"""`peerd bench blocks`: decode and prefill tokens/s of one span beside the whole local model
(embeddings, every block, LM head), measured side by side in one run on this machine."""

from __future__ import annotations

import torch

import blocks


def run_blocks_bench(
    model: str = "default",
    start: int = 0,
    end: int = 10,
    serving: blocks.Serving | None = None,
) -> dict[str, object]:
    """Fresh measurements (the throughput cache on disk is neither read nor written) on
    `serving`'s device, in its dtype, the blocks quantized as it says (the client side is never
    quantized: servers quantize blocks, clients keep their embeddings and LM head).

    `*_decode_gbps` is the weight bytes a decode step reads times steps/s: how close decoding
    comes to the memory bandwidth, the limit of single-sequence decoding. `span_decode_time_share`
    is the span's decode step time over the whole model's, beside `span_block_share`.
    """
    serving = serving or blocks.Serving()
    dtype, device, quant = serving.dtype, serving.device, serving.quant
    checkpoint = blocks.resolve_checkpoint(model)
    span = blocks.load_span(checkpoint, start, end, dtype, device, quant=quant)
    span_speed = blocks.measure_throughput(span, use_disk_cache=False)
    num_blocks = int(span.config.num_hidden_layers)
    full = blocks.load_span(checkpoint, 0, num_blocks, dtype, device, quant=quant)
    client = blocks.load_client_side(checkpoint, dtype, device)
    full_speed = blocks.measure_throughput(full, client=client, use_disk_cache=False)
    full_bytes = full.weight_bytes + sum(
        p.numel() * p.element_size() for p in client.parameters()
    )  # parameters() yields a tied LM head once
    return {
        "model": span.model,
        "span": f"{start}:{end}",
        "blocks": num_blocks,
        "device": str(span.device),
        "dtype": serving.dtype_name,
        "quant": quant,
        "span_weight_bytes": span.weight_bytes,
        "threads": torch.get_num_threads(),
        "span_decode_tps": round(span_speed.decode_tps, 2),
        "span_prefill_tps": round(span_speed.prefill_tps, 2),
        "full_decode_tps": round(full_speed.decode_tps, 2),
        "full_prefill_tps": round(full_speed.prefill_tps, 2),
        "span_decode_time_share": round(full_speed.decode_tps / span_speed.decode_tps, 3),
        "span_block_share": round((end - start) / num_blocks, 3),
        "span_decode_gbps": round(span.weight_bytes * span_speed.decode_tps / 1e9, 2),
        "full_decode_gbps": round(full_bytes * full_speed.decode_tps / 1e9, 2),
    }
