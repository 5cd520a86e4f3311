"""The `peerd` command line: one typer app whose commands call into peerd/ (imported lazily so
`peerd --help` stays fast)."""

from __future__ import annotations

import json

import typer

app = typer.Typer(
    help="peerd: run a large language model across a swarm of volunteer machines.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks that report ratios measured side by side in one run.")
app.add_typer(bench_app, name="bench")


def _print_report(report: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(report))
        return
    for key, value in report.items():
        typer.echo(f"{key}: {value}")


@bench_app.command("wire")
def bench_wire(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    repeats: int = typer.Option(5, min=1, help="Timed repetitions per codec (the best is kept)."),
) -> None:
    """Encode+decode throughput, size ratio and error of every tensor codec, beside torch.clone."""
    from peerd.bench.wire import run_wire_bench

    report = run_wire_bench(repeats=repeats)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        from peerd.bench.wire import format_wire_report

        typer.echo(format_wire_report(report))


@bench_app.command("blocks")
def bench_blocks(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    model: str = typer.Option("default", help="'default' (SmolLM2-135M) or a checkpoint dir."),
    start: int = typer.Option(0, min=0, help="First block of the span."),
    end: int = typer.Option(10, min=1, help="One past the last block of the span."),
    device: str = typer.Option("cpu", help="torch device to run on, e.g. cpu or cuda:0."),
) -> None:
    """Decode and prefill tokens/s of a span beside the whole local model, in one run."""
    from blocks import BlocksError
    from peerd.bench.blocks import run_blocks_bench

    try:
        report = run_blocks_bench(model, start, end, device)
    except (BlocksError, ValueError) as e:
        typer.echo(f"peerd bench blocks: {e}", err=True)
        raise typer.Exit(2) from None
    _print_report(report, as_json)

if __name__ == "__main__":
    app()
