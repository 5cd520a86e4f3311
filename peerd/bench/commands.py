"""`peerd bench` commands that live beside their benchmark (cli.py registers them). Only typer
is imported at the top, so `peerd --help` stays fast; the benchmark loads when a command runs.
"""

from __future__ import annotations

import json

import typer


def bench_fairness(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    takers: int = typer.Option(4, min=1, help="Pure-client peers loading the swarm."),
    sessions_per_taker: int = typer.Option(2, min=1, help="Sessions of each pure client."),
    new_tokens: int = typer.Option(24, min=4, help="Tokens per contributor generation."),
    priority: list[str] = typer.Option(
        ["standing", "fifo"], "--priority", help="Modes to run (repeatable): standing, fifo."
    ),
) -> None:
    """Three local daemons saturated by pure clients while a daemon that serves blocks generates
    too: per class token latency (against unloaded) and share of work, --priority standing
    beside fifo (docs/swarm.md#standing)."""
    import logging

    from peerd.bench.fairness import run_fairness_bench

    logging.basicConfig(level=logging.WARNING)
    report = run_fairness_bench(
        takers=takers,
        sessions_per_taker=sessions_per_taker,
        new_tokens=new_tokens,
        modes=tuple(priority),
    )
    typer.echo(json.dumps(report) if as_json else "\n".join(f"{k}: {v}" for k, v in report.items()))


def bench_blocks(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    model: str = typer.Option("default", help="'default' (SmolLM2-135M) or a checkpoint dir."),
    start: int = typer.Option(0, min=0, help="First block of the span."),
    end: int = typer.Option(10, min=1, help="One past the last block of the span."),
    device: str = typer.Option("cpu", help="auto, cpu, cuda, cuda:N or mps (as peerd start)."),
    dtype: str = typer.Option("float32", help="auto, float32, bfloat16 or float16."),
    quant: str = typer.Option("none", help="Weight quantization: none, int8 or nf4."),
) -> None:
    """Decode and prefill tokens/s of a span beside the whole local model, in one run, on a
    device in a dtype and quantization (docs/blocks.md#device-dtype-and-quantization)."""
    from blocks import BlocksError, resolve_serving
    from peerd.bench.blocks import run_blocks_bench

    try:
        report = run_blocks_bench(model, start, end, resolve_serving(device, dtype, quant))
    except (BlocksError, ValueError) as e:
        typer.echo(f"peerd bench blocks: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(report) if as_json else "\n".join(f"{k}: {v}" for k, v in report.items()))


def bench_prefill(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    runs: int = typer.Option(5, min=1, help="Repetitions of each; medians are reported."),
    repeat: int = typer.Option(3, min=1, help="The prompt: bench swarm's this many times over."),
    colocated: bool = typer.Option(True, help="Also run three daemons sharing every core."),
    new_tokens: int = typer.Option(4, min=1, help="Greedy tokens per generation, compared."),
) -> None:
    """A long prompt's first token through local daemons, whole against pipelined in chunks:
    two daemons pinned to a core each (two machines), then three sharing the cores."""
    import logging

    from peerd.bench.prefill import run_prefill_bench

    logging.basicConfig(level=logging.WARNING)
    try:
        report = run_prefill_bench(
            runs=runs, repeat=repeat, colocated=colocated, new_tokens=new_tokens
        )
    except ValueError as e:
        typer.echo(f"peerd bench prefill: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(report) if as_json else "\n".join(f"{k}: {v}" for k, v in report.items()))
