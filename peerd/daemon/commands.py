"""The commands that run this daemon: `peerd start` and `peerd service install|uninstall`.

cli.py registers them on its typer app. This module imports only typer at the top, so `peerd
--help` stays fast; the daemon and its dependencies load when a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from peerd.daemon.main import DaemonConfig

service_app = typer.Typer(
    help="A systemd unit that keeps `peerd start ...` running (docs/operations.md)."
)

# `peerd start`'s flags. Each is named as the DaemonConfig field it sets (--drain-timeout sets
# drain_deadline, --verify verify_fraction, --swarm swarm_name), so the flags are the config.
MODEL = typer.Option(
    "default",
    help="'default' (SmolLM2-135M-Instruct), a checkpoint dir, or a Hugging Face id ORG/NAME "
    "(from the local Hub cache; else only the files its blocks need are fetched).",
)
BLOCKS = typer.Option(
    "auto", help="Blocks to serve: auto (what fits, where the swarm is weakest), N, or a:b."
)
NEW_SWARM = typer.Option(False, "--new-swarm", help="Start a new swarm (no peers).")
INITIAL_PEERS = typer.Option(
    [], "--initial-peers", help="Full multiaddr of a peer to join through (repeatable)."
)
PORT = typer.Option(0, help="TCP port to listen on (0: any free port).")
HOST_MADDRS = typer.Option([], "--host-maddrs", help="Listen multiaddrs.")
IDENTITY = typer.Option(
    None,
    help="Identity file, created on first use (default: one per --socket, in "
    "$PEERD_STATE_DIR or ~/.local/state/peerd).",
)
THROUGHPUT = typer.Option("auto", help="auto (measure once, cached) or tokens/s.")
MEMORY_BUDGET = typer.Option(
    None,
    help="Bytes for weights + cache with --blocks auto (default: half of free RAM); --compile's "
    "packed copies get what it leaves.",
)
CACHE_TOKENS = typer.Option(16384, min=1, help="KV cache budget in tokens.")
REFRESH_PERIOD = typer.Option(60.0, min=0.1, help="Seconds between DHT announces.")
REBALANCE_PERIOD = typer.Option(
    120.0, min=0.1, help="With --blocks auto or N: seconds between checks for a better span."
)
TORCH_THREADS = typer.Option(
    None, min=1, help="torch threads for compute (decode steps: passes of few tokens)."
)
PREFILL_THREADS = typer.Option(
    None,
    min=1,
    help="torch threads for passes of 16 tokens or more (prompts); default: every core this "
    "process may use when --torch-threads is given (docs/operations.md).",
)
SOCKET = typer.Option(None, help="Local API socket (default: $XDG_RUNTIME_DIR/peerd/peerd.sock).")
LOG_LEVEL = typer.Option("info", help="debug, info, warning or error.")
DRAIN_DEADLINE = typer.Option(
    30.0,
    "--drain-timeout",
    min=0.0,
    help="On SIGTERM: seconds open sessions may go on before they move.",
)
METRICS_PORT = typer.Option(
    None, min=0, max=65535, help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics."
)
MDNS = typer.Option(
    False, "--mdns", help="Find and join peers on the LAN (no --initial-peers needed)."
)
SWARM_NAME = typer.Option(
    "", "--swarm", help="Name of a private swarm: daemons of other swarms are never used."
)
ADAPTERS = typer.Option(
    [], "--adapters", help="PEFT LoRA adapter dir to serve, known by its name (repeatable)."
)
VERIFY_FRACTION = typer.Option(
    0.0,
    "--verify",
    min=0.0,
    max=1.0,
    help="Re-run this fraction of generation steps on a second server and ban liars.",
)
BATCHING = typer.Option(
    True, "--batching/--no-batching", help="Merge concurrent clients' steps into one forward."
)
MAX_BATCH_SIZE = typer.Option(
    32, min=1, help="Most rows (sequences) one merged forward of clients' steps may take."
)
ANNOUNCE_MADDRS = typer.Option(
    [],
    "--announce-maddrs",
    help="Tell peers to dial this multiaddr instead of our own addresses (repeatable).",
)
PUBLIC_IP = typer.Option(
    None, "--public-ip", help="Our public IP (port forwarding, cloud): announced first."
)
PUBLIC_NAME = typer.Option(
    "", "--public-name", help="A name for this server in status pages (Petals' public_name)."
)
CLIENT_MODELS = typer.Option(
    ["default"],
    "--client-models",
    help="Another model local programs may generate with when the swarm serves it: 'default' "
    "or a checkpoint dir (repeatable; `peerd generate --model NAME`).",
)
DEVICE = typer.Option(
    "cpu",
    help="Where blocks, KV cache and client side run: auto (a GPU if any), cpu, cuda, cuda:N "
    "or mps.",
)
DTYPE = typer.Option(
    "float32",
    help="Serving dtype of weights, activations and KV cache: auto (half precision on a GPU; "
    "on a CPU bfloat16 only where one block decodes clearly faster in it), float32, bfloat16 "
    "or float16.",
)
QUANT = typer.Option(
    "none", help="Weight quantization of the served blocks (bitsandbytes): none, int8 or nf4."
)
REACHABILITY = typer.Option(
    "auto", help="auto (peers dial us back: AutoNAT), public, or private (behind NAT: use relays)."
)
PIPELINE_PROMPTS = typer.Option(
    "auto",
    help="Send long prompts through the route in chunks, each server starting while the one "
    "before computes the next: auto (when no two servers share a host), on, off. "
    "docs/swarm.md#pipelined-prompts",
)
COMPILE = typer.Option(
    True,
    "--compile/--no-compile",
    envvar="PEERD_COMPILE",
    help="Compile the span's decode steps, merged steps of 2-4 sessions and prompts (first passes "
    "and after a past) on a CPU (torch.compile: 10-40 s at start, needs g++; faster passes), "
    "where they can run, and keep packed copies of its weights for merged steps of 5-15 "
    "sessions where that is faster (within "
    "--memory-budget). docs/blocks.md#compiled-passes",
)
PRIORITY = typer.Option(
    "standing",
    help="When loaded, serve first: standing (peers that serve this model, takers keep 20%) "
    "or fifo (everyone alike). docs/swarm.md#standing",
)


def start(
    ctx: typer.Context,
    model: str = MODEL,
    blocks: str = BLOCKS,
    new_swarm: bool = NEW_SWARM,
    initial_peers: list[str] = INITIAL_PEERS,
    port: int = PORT,
    host_maddrs: list[str] = HOST_MADDRS,
    identity: Path | None = IDENTITY,
    throughput: str = THROUGHPUT,
    memory_budget: int | None = MEMORY_BUDGET,
    cache_tokens: int = CACHE_TOKENS,
    refresh_period: float = REFRESH_PERIOD,
    rebalance_period: float = REBALANCE_PERIOD,
    torch_threads: int | None = TORCH_THREADS,
    prefill_threads: int | None = PREFILL_THREADS,
    socket: Path | None = SOCKET,
    log_level: str = LOG_LEVEL,
    drain_deadline: float = DRAIN_DEADLINE,
    metrics_port: int | None = METRICS_PORT,
    mdns: bool = MDNS,
    swarm_name: str = SWARM_NAME,
    adapters: list[Path] = ADAPTERS,
    verify_fraction: float = VERIFY_FRACTION,
    pipeline_prompts: str = PIPELINE_PROMPTS,
    batching: bool = BATCHING,
    compile: bool = COMPILE,
    max_batch_size: int = MAX_BATCH_SIZE,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quant: str = QUANT,
    reachability: str = REACHABILITY,
    announce_maddrs: list[str] = ANNOUNCE_MADDRS,
    public_ip: str | None = PUBLIC_IP,
    public_name: str = PUBLIC_NAME,
    client_models: list[str] = CLIENT_MODELS,
    priority: str = PRIORITY,
) -> None:
    """Serve blocks of a model to the swarm and route generations for local clients."""
    from peerd.daemon.main import DaemonError, configure_logging, run
    from peerd.node.p2p import BadMultiaddr

    configure_logging(log_level)
    config = _daemon_config(dict(ctx.params))
    try:
        run(config)
    except (DaemonError, BadMultiaddr, OSError) as e:
        typer.echo(f"peerd start: {e}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        pass


def _daemon_config(flags: dict[str, Any]) -> DaemonConfig:
    """The DaemonConfig of `peerd start`'s flags, refusing combinations that cannot work."""
    from peerd.daemon.main import DaemonConfig

    if not flags["new_swarm"] and not flags["initial_peers"] and not flags["mdns"]:
        raise typer.BadParameter(
            "give --initial-peers MULTIADDR to join a swarm, --new-swarm to start one, or --mdns "
            "to find one on the LAN",
            param_hint="--initial-peers",
        )
    if flags["new_swarm"] and flags["initial_peers"]:
        raise typer.BadParameter("--new-swarm takes no --initial-peers", param_hint="--new-swarm")
    if flags["reachability"] not in ("auto", "public", "private"):
        raise typer.BadParameter(
            f"{flags['reachability']!r}: expected auto, public or private",
            param_hint="--reachability",
        )
    from peerd.node.addresses import BadAnnounceAddr, check_announce

    try:
        check_announce(flags["announce_maddrs"], flags["public_ip"])
    except BadAnnounceAddr as e:
        hint = "--public-ip" if "--public-ip" in str(e) else "--announce-maddrs"
        raise typer.BadParameter(str(e).split(": ", 1)[1], param_hint=hint) from None
    _check_public_name(flags["public_name"])
    modes = {"auto": None, "on": True, "off": False}
    if flags["pipeline_prompts"] not in modes:
        raise typer.BadParameter(
            f"{flags['pipeline_prompts']!r}: expected auto, on or off",
            param_hint="--pipeline-prompts",
        )
    flags["pipeline_prompts"] = modes[flags["pipeline_prompts"]]
    if flags["priority"] not in ("standing", "fifo"):
        raise typer.BadParameter(
            f"{flags['priority']!r}: expected standing or fifo", param_hint="--priority"
        )
    del flags["log_level"]  # the process's, not the daemon's
    if flags["blocks"] == "none":
        flags["blocks"] = None  # serve nothing: a pure client of the swarm
    for many in ("initial_peers", "host_maddrs", "adapters", "announce_maddrs", "client_models"):
        flags[many] = list(flags[many])
    from peerd.server.block_server import ServerLimits

    flags["limits"] = ServerLimits(max_merged_rows=flags.pop("max_batch_size"))
    on = (flags.pop("device"), flags.pop("dtype"), flags.pop("quant"))
    flags["serving"] = _serving(*on, flags["model"])
    return DaemonConfig(**flags)


def _serving(device: str, dtype: str, quant: str, model: str) -> Any:
    """--device, --dtype and --quant resolved on this machine for `model` (blocks.serving), or
    the flag to change and why."""
    import contextlib

    import blocks

    checkpoint = None
    # --dtype auto on a CPU measures this model's blocks; a bad --model is the daemon's to report.
    with contextlib.suppress(blocks.BlocksError):
        checkpoint = blocks.resolve_checkpoint(model) if dtype.strip() == "auto" else None
    try:
        return blocks.resolve_serving(device, dtype, quant, checkpoint)
    except blocks.ServingError as e:
        flag, _, why = str(e).partition(": ")
        raise typer.BadParameter(why, param_hint=flag.split(" ")[0]) from None


def _check_public_name(name: str) -> None:
    from wire.peer_protocol import MAX_PUBLIC_NAME_LEN

    if len(name) > MAX_PUBLIC_NAME_LEN or not name.isprintable():
        raise typer.BadParameter(
            f"{name!r}: give at most {MAX_PUBLIC_NAME_LEN} printable characters (it is "
            "shown to everyone in status pages)",
            param_hint="--public-name",
        )


@service_app.command("install", context_settings={"allow_interspersed_args": False})
def service_install(
    start_args: list[str] = typer.Argument(
        None, help="Arguments of `peerd start`, after `--`: peerd service install -- --new-swarm"
    ),
    user: bool = typer.Option(False, "--user", help="A user unit (systemctl --user)."),
    print_only: bool = typer.Option(False, "--print", help="Print the unit; write nothing."),
    run_as: str | None = typer.Option(
        None, help="System unit: the account that runs the daemon (default: who ran sudo)."
    ),
    unit_dir: Path | None = typer.Option(
        None, help="Write the unit and its environment file here instead (no systemctl)."
    ),
) -> None:
    """Write a systemd unit (and an environment file) for `peerd start START_ARGS`."""
    from peerd.daemon.service import ServiceError, ServiceSpec, default_run_as, install, unit_text

    spec = ServiceSpec(
        start_args=tuple(start_args or ()),
        user=user,
        run_as=None if user else (run_as or default_run_as()),
        env_file=unit_dir / "peerd.env" if unit_dir else None,
    )
    try:
        if print_only:
            typer.echo(unit_text(spec), nl=False)
            return
        installed = install(spec, unit_dir, reload=unit_dir is None)
    except (ServiceError, OSError) as e:
        typer.echo(f"peerd service install: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {installed.unit} (settings in {installed.env_file})")
    typer.echo(f"start it now and at boot: {installed.enable_hint}")


@service_app.command("uninstall")
def service_uninstall(
    user: bool = typer.Option(False, "--user", help="The user unit (systemctl --user)."),
    unit_dir: Path | None = typer.Option(None, help="The unit is here instead."),
) -> None:
    """Stop and disable the peerd service and remove its unit (identity and cache stay)."""
    from peerd.daemon.service import uninstall

    removed = uninstall(user, unit_dir, reload=unit_dir is None)
    typer.echo(f"removed {removed}" if removed else "no peerd service was installed")
