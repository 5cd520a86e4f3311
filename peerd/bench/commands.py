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
