"""`peerd bench swarm`: greedy generation through three local daemons (10/10/10 blocks of the
default model) against the whole model in one process with transformers, in the same run.

Reported as ratios (the machine is noisy): decode tokens/s through the swarm (server-to-server
push) over local decode tokens/s, the same for the prompt (prefill), and push over the
client-relayed path; medians over `runs` repetitions. A prompt is one pass, so each repetition
times PREFILL_PAIRS more of them, a local prefill and the swarm's first token in turn, and its
`prefill_ratio` is the median local prefill over the median first token of all its pairs: one
pair alone moved by up to 1.6x between repetitions of one run (docs/swarm.md).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import trio

import blocks
from peerd.devtools.localswarm import LocalSwarm
from peerd.node import compute_thread
from peerd.session.inference import InferenceSession
from peerd.session.leech import Leech, open_leech

# Extra (local prefill, swarm first token) pairs per repetition, beside its decode runs' own.
PREFILL_PAIRS = 4

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
    "a goldsmith from Mainz, combined movable metal type, oil-based ink and a wooden screw press "
    "into a system that could produce books far faster than scribes. Within fifty years printing "
    "shops had opened in more than two hundred cities across Europe, and the price of books fell "
    "sharply. Scholars argue about how much this changed the world, but"
)


def _prompt_ids(tokenizer: Any) -> torch.Tensor:
    return tokenizer(PROMPT, return_tensors="pt")["input_ids"]


def _local_run(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode tokens/s, tokens) of greedy generation by transformers (on the
    compute thread, where the swarm's client does its passes: see run_swarm_bench). Each pass
    computes the last position's logits alone, as transformers' own `generate` has it do
    (`logits_to_keep=1`): the prompt's other 83 rows of logits are work nobody needs, and the
    swarm's client does not do it either."""
    from transformers import DynamicCache

    blocks.threads.apply(ids.shape[1])  # the policy's count (run_swarm_bench: one for all passes)
    with torch.inference_mode():
        started = time.perf_counter()
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        prefill_s = time.perf_counter() - started
        tokens = [int(token)]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(
                token, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1
            )
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
        decode_tps = (new_tokens - 1) / (time.perf_counter() - started)
    return prefill_s, decode_tps, tokens


async def _swarm_run(
    leech: Leech, ids: torch.Tensor, new_tokens: int, push: bool = True
) -> tuple[float, float, list[int]]:
    """(time to first token, decode tokens/s, tokens) of greedy generation through the swarm."""
    tokens: list[int] = []
    started = time.perf_counter()
    first_at = 0.0
    async with InferenceSession(
        leech.swarm, max_length=ids.shape[1] + new_tokens, push=push, open_with_first_step=True
    ) as session:
        async for token in leech.generator.generate(ids, new_tokens, session=session):
            tokens.append(int(token[0, 0]))
            if len(tokens) == 1:
                first_at = time.perf_counter()
        finished = time.perf_counter()
    decode_tps = (new_tokens - 1) / (finished - first_at) if new_tokens > 1 else 0.0
    return first_at - started, decode_tps, tokens


async def _repetition(
    leech: Leech, model: Any, ids: torch.Tensor, new_tokens: int
) -> tuple[dict[str, float], bool]:
    """One repetition's figures, and whether local, push and relayed decoding gave the same
    tokens: a decode run of each, then PREFILL_PAIRS more (local prefill, first token) pairs."""
    local_prefill, local_tps, local_tokens = await compute_thread.run(
        _local_run, model, ids, new_tokens
    )
    ttft, tps, swarm_tokens = await _swarm_run(leech, ids, new_tokens)
    _, relay_tps, relay_tokens = await _swarm_run(leech, ids, new_tokens, False)
    local_prefills, ttfts = [local_prefill], [ttft]
    for _ in range(PREFILL_PAIRS):
        local_prefills.append((await compute_thread.run(_local_run, model, ids, 1))[0])
        ttfts.append((await _swarm_run(leech, ids, 1))[0])
    local_prefill, ttft = statistics.median(local_prefills), statistics.median(ttfts)
    row = {
        "decode_tps": tps,
        "local_decode_tps": local_tps,
        "relay_decode_tps": relay_tps,
        "push_speedup": tps / relay_tps,
        "ratio": tps / local_tps,
        "prefill_ratio": local_prefill / ttft,
        # The decode runs' own pair, as prefill_ratio was before the pairs.
        "first_pair_prefill_ratio": local_prefills[0] / ttfts[0],
        "ttft_s": ttft,
        "local_prefill_s": local_prefill,
    }
    return row, local_tokens == swarm_tokens == relay_tokens


def run_swarm_bench(runs: int = 3, new_tokens: int = 64, torch_threads: int = 2) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    # Every torch pass here (the local model, the client's LM head) runs on the compute thread
    # with `torch_threads` threads, as in a daemon (peerd.node.compute_thread).
    blocks.threads.configure(torch_threads, torch_threads)
    compute_thread.quiet_event_loop_thread()
    checkpoint = blocks.resolve_checkpoint("default")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    client = blocks.load_client_side(checkpoint)
    ids = _prompt_ids(client.tokenizer)
    # Each daemon (a machine of its own) gets the local model's threads: one generation's step is
    # on one hop at a time, and idle OpenMP threads sleep after a short spin (peerd/__init__.py).
    swarm = LocalSwarm(refresh_period=30.0, torch_threads=torch_threads, throughput="auto")
    try:
        for name, span in (("a", "0:10"), ("b", "10:20"), ("c", "20:30")):
            swarm.start(name, span, online=True)

        async def measure() -> dict[str, Any]:
            rows: list[dict[str, float]] = []
            same = True
            async with open_leech("default", swarm.initial_peers, refresh_period=30.0) as leech:
                await _swarm_run(leech, ids, 4)  # warm-up: connections, first allocations
                await compute_thread.run(_local_run, model, ids, 4)
                for _ in range(runs):
                    row, same_tokens = await _repetition(leech, model, ids, new_tokens)
                    rows.append(row)
                    same &= same_tokens
                route = leech.swarm.plan()
            report: dict[str, Any] = {
                key: statistics.median(row[key] for row in rows) for key in rows[0]
            }
            report.update(
                runs=runs,
                new_tokens=new_tokens,
                prompt_tokens=int(ids.shape[1]),
                same_tokens_as_local=same,
                prefill_pairs=PREFILL_PAIRS + 1,
                route=[f"{hop.start}:{hop.end}@{hop.peer_id[-8:]}" for hop in route],
                all_ratios=[row["ratio"] for row in rows],
            )
            return report

        return trio.run(measure)
    finally:
        swarm.stop()
