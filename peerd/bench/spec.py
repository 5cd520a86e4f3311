"""`peerd bench spec`: speculative decoding against plain decoding on the emulated WAN of
`peerd bench wan` (three servers of the default model, 25 ms one way on every link, the client
in its own namespace), both in the same run, for two prompts:

- copy: rewrite a given paragraph with small edits, where prompt lookup's drafts mostly stand;
- chat: an open question in the chat template, where few drafts stand and `auto` must not cost.

Each is generated greedily with --speculate off and with auto, alternating, and the report gives
tokens/s of each (prefill excluded: from the first token to the last), the speedup, the tokens
accepted per pass through the swarm, and whether both produced the same tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import typer

COPY_PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
    "a goldsmith from Mainz, combined movable metal type, oil-based ink and a wooden screw press "
    "into a system that could produce books far faster than scribes. Within fifty years printing "
    "shops had opened in more than two hundred cities across Europe, and the price of books fell "
    "sharply."
)
COPY_PROMPT = (
    "Rewrite the following paragraph, changing only 'goldsmith' to 'metalworker' and keeping "
    f"every other word the same.\n\n{COPY_PARAGRAPH}\n\nRewritten paragraph:\n"
)
CHAT_PROMPT = "What are three good habits for staying healthy while working from home?"
NEW_TOKENS = 64


def run_spec_bench(new_tokens: int = NEW_TOKENS, runs: int = 2) -> dict[str, Any]:
    """Build the WAN of `peerd bench wan`, run the measurement in the client's namespace."""
    from peerd.bench.wan import DELAY_MS, RATE_MBIT, SPANS, run_on_emulated_wan

    report, _ = run_on_emulated_wan("peerd.bench.spec", new_tokens, runs, timeout_s=1200)
    report["link"] = {"one_way_delay_ms": DELAY_MS, "rate_mbit": RATE_MBIT, "hops": len(SPANS)}
    return report


async def _timed(
    leech: Any, ids: Any, new_tokens: int, speculate: Any
) -> tuple[float, list[int], Any]:
    """(decode tokens/s from the first token on, tokens, tally) of one greedy generation."""
    from peerd.session.inference import InferenceSession
    from peerd.session.speculative import Tally

    tally = Tally()
    tokens: list[int] = []
    first_at = 0.0
    async with InferenceSession(
        leech.swarm, max_length=ids.shape[1] + new_tokens, open_with_first_step=True
    ) as session:
        stream = leech.generator.generate(
            ids, new_tokens, session=session, speculate=speculate, tally=tally
        )
        async for token in stream:
            tokens.append(int(token[0, 0]))
            if len(tokens) == 1:
                first_at = time.perf_counter()
        finished = time.perf_counter()
    return (len(tokens) - 1) / (finished - first_at), tokens, tally


async def _compare(leech: Any, ids: Any, new_tokens: int, runs: int) -> dict[str, Any]:
    from peerd.session.speculative import parse_speculate

    plain: list[float] = []
    spec: list[float] = []
    same = True
    per_pass: list[float] = []
    drafted: list[int] = []
    for _ in range(runs):
        tps, reference, _ = await _timed(leech, ids, new_tokens, None)
        plain.append(tps)
        tps, tokens, tally = await _timed(leech, ids, new_tokens, parse_speculate("auto"))
        spec.append(tps)
        same = same and tokens == reference
        # The first pass is the prompt's: the tokens after it over the passes after it.
        per_pass.append((tally.tokens - 1) / max(tally.passes - 1, 1))
        drafted.append(tally.drafted)
    tps_plain, tps_spec = statistics.median(plain), statistics.median(spec)
    return {
        "tps_plain": tps_plain,
        "tps_spec": tps_spec,
        "speedup": tps_spec / tps_plain,
        "accepted_per_pass": statistics.median(per_pass),
        "same_tokens": same,
        "drafted": drafted,
        "all_tps_plain": plain,
        "all_tps_spec": spec,
    }


def _inner(initial_peer: str, listen: str, new_tokens: int, runs: int) -> dict[str, Any]:
    import torch
    import trio

    from peerd.bench.wan import REFRESH_S
    from peerd.session.generation import encode_prompt
    from peerd.session.leech import open_leech

    torch.set_num_threads(1)

    async def measure() -> dict[str, Any]:
        async with open_leech(
            "default", [initial_peer], refresh_period=REFRESH_S, listen=f"/ip4/{listen}/tcp/0"
        ) as leech:
            tokenizer = leech.client.tokenizer
            copy_ids = encode_prompt(tokenizer, COPY_PROMPT, chat=True)
            chat_ids = encode_prompt(tokenizer, CHAT_PROMPT, chat=True)
            await _timed(leech, chat_ids, 4, None)  # warm-up: connections, first allocations
            report: dict[str, Any] = {
                "copy": await _compare(leech, copy_ids, new_tokens, runs),
                "chat": await _compare(leech, chat_ids, new_tokens, runs),
            }
            route = leech.swarm.plan()
        report["route"] = [f"{hop.start}:{hop.end}@{hop.peer_id[-8:]}" for hop in route]
        report["new_tokens"] = new_tokens
        report["runs"] = runs
        return report

    return trio.run(measure)


def bench_spec(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    runs: int = typer.Option(2, min=1, help="Repetitions; medians are reported."),
    new_tokens: int = typer.Option(NEW_TOKENS, min=2, help="Greedy tokens per generation."),
) -> None:
    """The WAN of `peerd bench wan` (needs root): tokens/s with --speculate auto and off, in the
    same run, for a copy-heavy prompt and an open chat prompt, and whether the tokens agree
    (`peerd bench spec`; cli.py registers it)."""
    from peerd.devtools.netns import NetnsUnavailable

    try:
        report = run_spec_bench(new_tokens=new_tokens, runs=runs)
    except NetnsUnavailable as e:
        typer.echo(f"peerd bench spec: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(report))
        return
    for key, value in report.items():
        typer.echo(f"{key}: {value}")


def main() -> None:
    from peerd.bench.wan import inner_main

    inner_main("spec", _inner, NEW_TOKENS)


if __name__ == "__main__":
    main()
