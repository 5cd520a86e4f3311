"""The `peerd` command line: one typer app whose commands call into peerd/ (imported lazily so
`peerd --help` stays fast)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from peerd.bench.commands import bench_blocks, bench_fairness, bench_prefill
from peerd.bench.idle import bench_idle
from peerd.bench.scale import bench_scale
from peerd.bench.spec import bench_spec
from peerd.daemon.commands import service_app, start

# Compute hops of one generation run one after another in different processes on the same cores;
# OpenMP threads that spin after their work would steal the core from the next hop.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

app = typer.Typer(
    help="peerd: run a large language model across a swarm of volunteer machines.",
    no_args_is_help=True,
    add_completion=False,
    # click's plain help: rich's option tables cut long defaults and paths at 80 columns.
    rich_markup_mode=None,
)
bench_app = typer.Typer(help="Benchmarks that report ratios measured side by side in one run.")
app.add_typer(bench_app, name="bench")
bench_app.command("spec", short_help="Speculative vs plain decoding on a WAN (root).")(bench_spec)
bench_app.command("scale", short_help="Simulated swarm of N peers: routing at scale.")(bench_scale)
bench_app.command("prefill", short_help="A long prompt: whole vs pipelined chunks.")(bench_prefill)
bench_app.command("idle", short_help="Three local daemons left idle: CPU share and memory.")(
    bench_idle
)
app.add_typer(service_app, name="service", short_help="A systemd unit that keeps a daemon running.")


def _print_report(report: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(report))
        return
    for key, value in report.items():
        typer.echo(f"{key}: {value}")


# `peerd start`: its flags and their checks live beside the daemon.
app.command(short_help="Serve blocks of a model to the swarm; route local generations.")(start)


@contextmanager
def _client(socket: Path | None, **routing: Any) -> Iterator[Any]:
    """A connection to the local daemon (with Client's routing controls); what the daemon
    refuses becomes a message and exit 1, no daemon at all or bad routing controls exit 2."""
    from peerd.paths import UnsafeDirectory
    from peerd.sdk.client import BadRouteOptions, Client, DaemonNotRunning, PeerdError

    try:
        client = Client(socket, **routing)
    except (DaemonNotRunning, BadRouteOptions, UnsafeDirectory) as e:
        typer.echo(f"peerd: {e}", err=True)
        raise typer.Exit(2) from None
    with client:
        try:
            yield client
        except PeerdError as e:
            typer.echo(f"peerd: {e}", err=True)
            raise typer.Exit(1) from None


def _options(
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float,
    seed: int | None,
    stop: list[str],
    adapter: str | None = None,
    model: str | None = None,
    speculate: str = "off",
) -> Any:
    from peerd.sdk.client import GenerateOptions

    return GenerateOptions(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=tuple(stop),
        active_adapter=adapter,
        model=model,
        speculate=speculate,
    )


SOCKET_OPTION = typer.Option(None, help="The daemon's local API socket (default: per-user).")
MAX_NEW_TOKENS = typer.Option(128, min=1, help="Most tokens to generate.")
DO_SAMPLE = typer.Option(False, "--do-sample", help="Sample instead of greedy decoding.")
TEMPERATURE = typer.Option(1.0, min=0.0, help="Sampling temperature.")
TOP_K = typer.Option(None, min=1, help="Sample among the k likeliest tokens.")
TOP_P = typer.Option(None, min=0.0, max=1.0, help="Nucleus sampling mass.")
REPETITION_PENALTY = typer.Option(1.0, min=0.0, help="Penalty for repeated tokens (>1).")
SEED = typer.Option(None, min=0, help="Seed for reproducible sampling.")
STOP = typer.Option([], "--stop", help="Stop sequence (repeatable).")
ADAPTER = typer.Option(
    None, "--adapter", help="LoRA adapter to generate with (`peerd status` lists them)."
)
MODEL_NAME = typer.Option(
    None,
    "--model",
    help="A model of the swarm by name (`peerd status` lists them; default: the daemon's).",
)
ALLOWED_SERVERS = typer.Option(
    [], "--allowed-server", help="Route only through this peer id (repeatable; default: any)."
)
BLOCKED_SERVERS = typer.Option(
    [], "--blocked-server", help="Never route through this peer id (repeatable)."
)
MAX_RETRIES = typer.Option(None, min=0, help="Failed servers to replace before giving up.")
CONNECT_TIMEOUT = typer.Option(None, min=0.001, help="Seconds to dial a server and open a hop.")
REQUEST_TIMEOUT = typer.Option(None, min=0.001, help="Seconds one step may take on one server.")
SHOW_ROUTE = typer.Option(False, "--show-route", help="Print the route used (to stderr).")
SPECULATE = typer.Option("auto", help="auto, ngram, draft:PATH or off: same tokens, fewer passes.")


def _routing(
    allowed: list[str],
    blocked: list[str],
    max_retries: int | None,
    connect_timeout: float | None,
    request_timeout: float | None,
    show_route: bool,
) -> dict[str, Any]:
    """Client keywords of the routing flags."""
    return {
        "allowed_servers": allowed or None,
        "blocked_servers": blocked,
        "max_retries": max_retries,
        "connect_timeout": connect_timeout,
        "request_timeout": request_timeout,
        "show_route": show_route,
    }


@app.command(short_help="Generate text once through the local daemon.")
def generate(
    prompt: str | None = typer.Argument(None, help="Text to continue (or a question with --chat)."),
    file: Path | None = typer.Option(
        None,
        "--file",
        help="Generate for every line of this file (one prompt a line) as one batch.",
    ),
    socket: Path | None = SOCKET_OPTION,
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the chat template."),
    max_new_tokens: int = MAX_NEW_TOKENS,
    do_sample: bool = DO_SAMPLE,
    temperature: float = TEMPERATURE,
    top_k: int | None = TOP_K,
    top_p: float | None = TOP_P,
    repetition_penalty: float = REPETITION_PENALTY,
    seed: int | None = SEED,
    stop: list[str] = STOP,
    adapter: str | None = ADAPTER,
    model: str | None = MODEL_NAME,
    allowed_server: list[str] = ALLOWED_SERVERS,
    blocked_server: list[str] = BLOCKED_SERVERS,
    max_retries: int | None = MAX_RETRIES,
    connect_timeout: float | None = CONNECT_TIMEOUT,
    request_timeout: float | None = REQUEST_TIMEOUT,
    show_route: bool = SHOW_ROUTE,
    speculate: str = SPECULATE,
) -> None:
    """Generate text once through the local daemon, streaming it to stdout; with --file, every
    prompt of the file in one batch, each answer under its prompt's number."""
    from peerd.sdk.terminal import stream_answer

    if (prompt is None) == (file is None):
        raise typer.BadParameter("give a PROMPT or --file PROMPTS.txt (not both)")
    options = _options(
        max_new_tokens,
        do_sample,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        seed,
        stop,
        adapter,
        model,
        speculate,
    )
    routing = _routing(
        allowed_server, blocked_server, max_retries, connect_timeout, request_timeout, show_route
    )
    if file is not None:
        prompts = _prompts_of(file)
        with _client(socket, **routing) as client:
            results = client.generate_batch(prompts, chat=chat, options=options)
        _print_answers(prompts, results)
        return
    assert prompt is not None
    with _client(socket, **routing) as client:
        stream_answer(client, prompt, sys.stdout, chat=chat, session=None, options=options)


def _prompts_of(file: Path) -> list[str]:
    """The prompts of a `peerd generate --file`: one a line, blank lines skipped."""
    try:
        prompts = [line for line in file.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise typer.BadParameter(f"cannot read {file}: {e}", param_hint="--file") from None
    if not prompts:
        raise typer.BadParameter(f"{file} holds no prompt (one a line)", param_hint="--file")
    return prompts


def _print_answers(prompts: list[str], results: list[Any]) -> None:
    """Each answer of a batch under its prompt's number, with its length and why it ended."""
    for number, (text, result) in enumerate(zip(prompts, results, strict=True), 1):
        typer.echo(f"=== [{number}] {text}")
        typer.echo(f"{result.text}\n--- ({len(result.token_ids)} tokens, {result.reason})")


@app.command(short_help="Chat with the model at the terminal.")
def chat(
    socket: Path | None = SOCKET_OPTION,
    prompt: str | None = typer.Option(None, help="Answer this one message and exit."),
    max_new_tokens: int = MAX_NEW_TOKENS,
    do_sample: bool = DO_SAMPLE,
    temperature: float = TEMPERATURE,
    top_k: int | None = TOP_K,
    top_p: float | None = TOP_P,
    repetition_penalty: float = REPETITION_PENALTY,
    seed: int | None = SEED,
    adapter: str | None = ADAPTER,
    model: str | None = MODEL_NAME,
    allowed_server: list[str] = ALLOWED_SERVERS,
    blocked_server: list[str] = BLOCKED_SERVERS,
    max_retries: int | None = MAX_RETRIES,
    connect_timeout: float | None = CONNECT_TIMEOUT,
    request_timeout: float | None = REQUEST_TIMEOUT,
    show_route: bool = SHOW_ROUTE,
    speculate: str = SPECULATE,
) -> None:
    """Chat with the model at the terminal (one conversation, servers keep its cache)."""
    from peerd.sdk.terminal import run_chat, stream_answer

    options = _options(
        max_new_tokens,
        do_sample,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        seed,
        [],
        adapter,
        model,
        speculate,
    )
    routing = _routing(
        allowed_server, blocked_server, max_retries, connect_timeout, request_timeout, show_route
    )
    with _client(socket, **routing) as client:
        if prompt is not None:
            stream_answer(client, prompt, sys.stdout, chat=True, session=None, options=options)
        else:
            run_chat(client, options)


@app.command(short_help="What the local daemon serves and which servers it sees.")
def status(
    socket: Path | None = SOCKET_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    watch: float | None = typer.Option(
        None, min=0.1, help="Refresh every SECONDS until Ctrl-C (in place on a terminal)."
    ),
    count: int | None = typer.Option(None, min=1, help="With --watch: stop after N refreshes."),
) -> None:
    """What the local daemon serves and which servers of the swarm it sees."""
    from peerd.sdk.terminal import format_status, status_table, watch_status

    if watch is not None and not as_json:
        from peerd.sdk.client import Client

        watch_status(lambda: Client(socket), watch, sys.stdout, count=count)
        return
    with _client(socket) as client:
        reply = client.status()
    if as_json:
        typer.echo(json.dumps(reply.to_dict()))
    elif sys.stdout.isatty():
        from rich.console import Console

        Console().print(status_table(reply))
    else:
        typer.echo(format_status(reply))


@app.command(short_help="Answer a prompt on a local swarm of three daemons, then stop.")
def demo(
    prompt: str = typer.Option("What is the capital of France?", help="The question to ask."),
    max_new_tokens: int = typer.Option(48, min=1),
) -> None:
    """Start a local swarm of three daemons on the default model, answer a prompt, stop."""
    from peerd.daemon.main import configure_logging
    from peerd.devtools.demo import run_demo

    configure_logging("warning")
    run_demo(prompt, max_new_tokens)


@app.command(short_help="HTTP, OpenAI-compatible and WebSocket APIs, web chat, /swarm.")
def gateway(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port to listen on."),
    socket: Path | None = typer.Option(
        None, help="The daemon's local API socket (default: $PEERD_SOCKET, then the per-user one)."
    ),
    model: Path | None = typer.Option(
        None, help="The daemon's model directory, when it is not the default (for its tokenizer)."
    ),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    swarm_refresh: float = typer.Option(
        5.0, min=0.1, help="Seconds between refreshes of the swarm monitor page (/swarm)."
    ),
    allowed_hosts: list[str] = typer.Option(
        [], "--allowed-hosts", help="A Host name it answers besides loopback (repeat; * any)."
    ),
    allowed_origins: list[str] = typer.Option(
        [], "--allowed-origins", help="Another site whose pages may use it (repeat; * any)."
    ),
    api_key: str | None = typer.Option(
        None,
        envvar="PEERD_GATEWAY_API_KEY",
        help="Key clients must send (Bearer); required off loopback. Prefer the env variable.",
    ),
) -> None:
    """chat.petals.dev-compatible and OpenAI-compatible APIs, a web chat page and a swarm monitor
    (/swarm), in front of the local daemon (docs/gateway.md)."""
    from peerd.gateway import serve
    from peerd.gateway.guard import Exposure

    try:
        exposure = Exposure.for_bind(
            host, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins, api_key=api_key
        )
    except ValueError as e:
        typer.echo(f"peerd gateway: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"peerd gateway: web chat and APIs on http://{host}:{port}/, swarm at /swarm")
    serve(host, port, socket, model, log_level, swarm_refresh, exposure)


@bench_app.command("wire", short_help="Throughput, size and error of every tensor codec.")
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


bench_app.command("blocks", short_help="Tokens/s of a span beside the whole model in one process.")(
    bench_blocks
)


@bench_app.command(
    "wan", short_help="Per-token latency on an emulated WAN, push on and off (root)."
)
def bench_wan(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    runs: int = typer.Option(2, min=1, help="Repetitions; medians are reported."),
    new_tokens: int = typer.Option(16, min=2, help="Greedy tokens per generation."),
) -> None:
    """3 servers and a client on an emulated WAN (25 ms one way, 100 Mbit/s per link; needs
    root): per-token latency against its floor, with server-to-server push on and off."""
    from peerd.bench.wan import run_wan_bench
    from peerd.devtools.netns import NetnsUnavailable

    try:
        report = run_wan_bench(new_tokens=new_tokens, runs=runs)
    except NetnsUnavailable as e:
        typer.echo(f"peerd bench wan: {e}", err=True)
        raise typer.Exit(2) from None
    _print_report(report, as_json)


@bench_app.command("swarm", short_help="Three local daemons vs the whole model in one process.")
def bench_swarm(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    runs: int = typer.Option(3, min=1, help="Repetitions; medians are reported."),
    new_tokens: int = typer.Option(64, min=2, help="Greedy tokens per generation."),
) -> None:
    """Three local daemons (10/10/10 blocks) vs the whole model in one process, same run."""
    from peerd.bench.swarm import run_swarm_bench
    from peerd.daemon.main import configure_logging

    configure_logging("warning")
    _print_report(run_swarm_bench(runs=runs, new_tokens=new_tokens), as_json)


@bench_app.command("soak", short_help="Generate while servers are killed and restarted.")
def bench_soak(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    duration: float = typer.Option(300.0, min=1.0, help="Seconds the clients keep generating."),
    clients: int = typer.Option(4, min=1, help="Clients generating at once."),
    kill_every: float = typer.Option(30.0, min=1.0, help="Seconds between server kills."),
    new_tokens: int = typer.Option(24, min=1, help="Greedy tokens per generation."),
    warmup: float | None = typer.Option(
        None, min=0.0, help="Seconds before the RSS baseline (default: a fifth, at most 60)."
    ),
) -> None:
    """Clients generate while servers are killed and restarted; failures, latency, RSS."""
    from peerd.bench.soak import run_soak_bench
    from peerd.daemon.main import configure_logging

    configure_logging("warning")
    try:
        report = run_soak_bench(
            duration_s=duration,
            clients=clients,
            kill_every_s=kill_every,
            new_tokens=new_tokens,
            warmup_s=warmup,
        )
    except ValueError as e:
        typer.echo(f"peerd bench soak: {e}", err=True)
        raise typer.Exit(2) from None
    _print_report(report, as_json)


@bench_app.command("batch", short_help="Concurrent sessions' tokens/s with and without batching.")
def bench_batch(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    runs: int = typer.Option(3, min=1, help="Rounds; medians are reported."),
    sessions: int = typer.Option(8, min=2, help="Concurrent sessions."),
    new_tokens: int = typer.Option(32, min=4, help="Greedy tokens per session."),
) -> None:
    """Aggregate decode tokens/s of concurrent sessions over one session, with server-side
    batching and without (three local daemons each), same run."""
    from peerd.bench.batch import run_batch_bench
    from peerd.daemon.main import configure_logging

    configure_logging("warning")
    _print_report(run_batch_bench(runs=runs, sessions=sessions, new_tokens=new_tokens), as_json)


bench_app.command("fairness", short_help="Token latency of contributors vs takers, loaded.")(
    bench_fairness
)


@bench_app.command("attack")
def bench_attack(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    attack_s: float = typer.Option(8.0, min=1.0, help="Seconds each flood lasts."),
    new_tokens: int = typer.Option(8, min=1, help="Greedy tokens per honest generation."),
    only: list[str] = typer.Option([], "--only", help="Run just this attack (repeat)."),
) -> None:
    """Every attack of the security review against a live 3-daemon swarm while an honest client
    generates: per attack, did the daemons live, the honest text stay right, memory and event
    loop hold (peerd/bench/attack.py)."""
    from peerd.bench.attack import run_attack_bench
    from peerd.daemon.main import configure_logging

    configure_logging("warning")
    try:
        report = run_attack_bench(attack_s=attack_s, new_tokens=new_tokens, only=tuple(only))
    except ValueError as e:
        typer.echo(f"peerd bench attack: {e}", err=True)
        raise typer.Exit(2) from None
    _print_report(report, as_json)


if __name__ == "__main__":
    from peerd.devtools.timeline import install_from_env

    install_from_env()  # PEERD_TIMELINE=DIR: a LocalSwarm's daemons time-stamp a token's path
    app()
