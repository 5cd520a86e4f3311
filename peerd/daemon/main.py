"""The peerd daemon: one trio process that owns the libp2p host, the DHT, the announcer, the
block server and the swarm view, and shuts all of them down cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

import blocks
import wire
from blocks.serving import Serving
from peerd import __version__
from peerd.daemon.api_connection import sole_cause
from peerd.daemon.contributions import watch_standing
from peerd.daemon.local_api import LocalApi, build_status
from peerd.daemon.logs import configure_logging as configure_logging
from peerd.daemon.models import ModelSetupError, SwarmModels, known_checkpoints
from peerd.daemon.startup import EXPECTED_FAILURES, claim_machine, load_serving_span, set_up_threads
from peerd.node.p2p import (
    INFERENCE_PROTOCOL,
    INFO_PROTOCOL,
    PUSH_PROTOCOL,
    TRAINING_PROTOCOL,
    Node,
    Reachability,
    join_discovered_peers,
    open_node,
    parse_peer_maddr,
    set_provider_record_ttl,
)
from peerd.paths import default_socket_path
from peerd.server.block_server import BlockServer, ServerLimits
from peerd.server.compute import ComputeQueue
from peerd.session.generation import Generator
from peerd.session.swarm import REFRESH_SLACK_S, SwarmView
from routing.block_selection import (
    better_span,
    blocks_that_fit,
    choose_blocks,
    first_to_move,
    recheck_delay,
)

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# Fraction of free RAM a `--blocks auto` server gives to weights and KV cache when no
# --memory-budget is set: the rest stays for the OS, torch's workspace and other programs.
AUTO_MEMORY_FRACTION = 0.5
# KV cache per server when not set: enough for a few long chats on the default model.
DEFAULT_CACHE_TOKENS = 16384
# How long SIGTERM waits for open sessions to finish before closing them.
DRAIN_DEADLINE_S = 30.0
# Seconds between AutoNAT checks until peers have given a verdict, and after.
REACHABILITY_FIRST_CHECKS_S = 2.0
REACHABILITY_RECHECK_S = 300.0
# --blocks auto: how many rechecks a server lets the first of its span (first_to_move) make a
# move they both want, before it makes the move itself.
MAX_DEFERRED_MOVES = 2


class DaemonError(Exception):
    """A setting the daemon cannot start with; the message says what to change."""


@dataclass
class DaemonConfig:
    model: str = "default"
    blocks: str | None = None  # None: serve nothing (a pure client); "auto", "N" or "a:b"
    new_swarm: bool = False
    initial_peers: list[str] = field(default_factory=list)
    port: int = 0
    host_maddrs: list[str] = field(default_factory=list)
    identity: Path | None = None
    throughput: str = "auto"
    memory_budget: int | None = None
    cache_tokens: int = DEFAULT_CACHE_TOKENS
    refresh_period: float = 60.0
    rebalance_period: float = 120.0  # --blocks auto|N: how often to re-check the span
    torch_threads: int | None = None
    prefill_threads: int | None = None  # None: every core, when torch_threads is set
    socket: Path | None = None  # None: the per-user default (peerd.paths.default_socket_path)
    drain_deadline: float = DRAIN_DEADLINE_S  # SIGTERM: how long open sessions may go on
    metrics_port: int | None = None  # serve Prometheus metrics on 127.0.0.1:PORT (0: any)
    mdns: bool = False  # find and join peers on the LAN
    swarm_name: str = ""  # a private swarm: its DHT keys differ from every other swarm's
    adapters: list[Path] = field(default_factory=list)  # PEFT LoRA directories to serve
    reachability: str = "auto"  # auto (AutoNAT), public or private (behind NAT: use relays)
    limits: ServerLimits = field(default_factory=ServerLimits)
    verify_fraction: float = 0.0  # spot-check this fraction of our sessions' steps (session.verify)
    pipeline_prompts: bool | None = None  # long prompts in chunks (session.steps; None: auto)
    batching: bool = True  # merge concurrent steps of different sessions into one forward
    compile: bool = False  # compile a CPU span's passes (blocks.compiled; on in peerd start)
    priority: str = "standing"  # who goes first when loaded: standing or fifo (server.priority)
    # What peers are told to dial (peerd.node.addresses): replaces our addresses / goes first.
    announce_maddrs: list[str] = field(default_factory=list)
    public_ip: str | None = None
    public_name: str = ""  # what our record calls us in status pages
    # Checkpoints whose client side local programs may use besides `model` (peerd.daemon.models)
    client_models: list[str] = field(default_factory=lambda: ["default"])
    serving: Serving = field(default_factory=Serving)  # --device --dtype --quant

    def listen_addrs(self) -> list[str]:
        return self.host_maddrs or [f"/ip4/0.0.0.0/tcp/{self.port}"]

    def socket_path(self) -> Path:
        return self.socket or default_socket_path()


def parse_blocks(text: str, num_blocks: int) -> tuple[str, int | None, int | None]:
    """ "auto" | "N" | "a:b" -> (kind, n_or_start, end), with errors a person can act on."""
    if text == "auto":
        return ("auto", None, None)
    unreadable = f"--blocks {text}: expected auto, a count like 10, or a span like 0:10"
    if ":" in text:
        a, _, b = text.partition(":")
        try:
            start, end = int(a), int(b)
        except ValueError:
            raise DaemonError(unreadable) from None
        if not 0 <= start < end <= num_blocks:
            raise DaemonError(
                f"--blocks {text}: the model has blocks 0:{num_blocks}; give a span a:b with "
                f"0 <= a < b <= {num_blocks}"
            )
        return ("span", start, end)
    try:
        count = int(text)
    except ValueError:
        raise DaemonError(unreadable) from None
    if not 1 <= count <= num_blocks:
        raise DaemonError(
            f"--blocks {text}: the model has {num_blocks} blocks; serve 1 to {num_blocks}"
        )
    return ("count", count, None)


def blocks_to_serve(
    model_config: PretrainedConfig,
    budget: int,
    cache_tokens: int,
    model: str = "the model",
    serving: blocks.Serving | None = None,
) -> int:
    """How many blocks a `--blocks auto` server takes on: each with its weights in the serving
    dtype and quantization (measured from the family's own layer, so every expert of a
    mixture-of-experts block counts) and a KV cache of `cache_tokens`, within `budget` bytes."""
    serving = serving or blocks.Serving()
    weights = blocks.block_bytes(model_config, serving.dtype, serving.quant)
    cache = blocks.cache_bytes_per_block(model_config, serving.dtype, cache_tokens)
    count = blocks_that_fit(budget, weights, cache, int(model_config.num_hidden_layers))
    if count < 1:
        raise DaemonError(
            f"a memory budget of {budget / 2**20:.0f} MiB does not fit one block of "
            f"{model} ({(weights + cache) / 2**20:.0f} MiB with its cache): raise "
            "--memory-budget or lower --cache-tokens"
        )
    return count


class Daemon:
    def __init__(self, config: DaemonConfig, key_pair: KeyPair) -> None:
        self.config = config
        self.key_pair = key_pair  # held by run() (peerd.daemon.startup)
        self.checkpoint = blocks.resolve_checkpoint(config.model)
        self.model = blocks.model_name(self.checkpoint)
        self.model_config = blocks.load_config(self.checkpoint)
        self.num_blocks = int(self.model_config.num_hidden_layers)
        self.compute = ComputeQueue()
        self.node: Node | None = None
        self.swarm: SwarmView | None = None
        self.server: BlockServer | None = None
        self.started_at = time.time()
        self.budget = config.memory_budget  # bytes for weights + cache; auto's, once chosen
        self.metrics_port: int | None = None  # the bound port, once serving metrics
        self.models: SwarmModels | None = None  # the swarm's models, once online
        self.api: LocalApi | None = None
        try:
            self.known_models = known_checkpoints(self.model, self.checkpoint, config.client_models)
        except ModelSetupError as e:
            raise DaemonError(str(e)) from None
        if config.blocks is not None:
            self.blocks_spec = parse_blocks(config.blocks, self.num_blocks)
        self.adapters = self._read_adapters(config.adapters)

    def _read_adapters(self, paths: list[Path]) -> list[blocks.AdapterInfo]:
        """Check every --adapters directory against the model now, before joining the swarm."""
        if paths and self.config.blocks is None:
            raise DaemonError("--adapters needs --blocks: only a server applies adapters")
        family = blocks.family_of(self.model_config)
        adapters: list[blocks.AdapterInfo] = []
        for path in paths:
            try:
                adapter = blocks.read_adapter(path, self.model_config, family)
            except blocks.AdapterError as e:
                raise DaemonError(f"--adapters {path}: {e}") from None
            if any(a.name == adapter.name for a in adapters):
                raise DaemonError(
                    f"--adapters: two adapter directories are named {adapter.name!r}; an adapter "
                    "is known by its directory's name, so rename one"
                )
            adapters.append(adapter)
        return adapters

    async def run(self) -> None:
        config = self.config
        set_up_threads(config.torch_threads, config.prefill_threads)
        set_provider_record_ttl(3 * config.refresh_period)  # re-provided each period: not 48 h
        async with open_node(
            self.key_pair,
            config.listen_addrs(),
            mdns=config.mdns,
            announce=config.announce_maddrs,
            public_ip=config.public_ip,
        ) as node:
            self.node = node
            self.swarm = SwarmView(
                node,
                self.model,
                self.num_blocks,
                refresh_period=config.refresh_period,
                own_record=lambda: self.server.record() if self.server else None,
                swarm_name=config.swarm_name,
            )
            self.swarm.verify_fraction = config.verify_fraction
            self.swarm.pipeline_prompts = config.pipeline_prompts
            self.swarm.directory.hold_records()  # of the DHT keys we are closest to
            ttl = 2 * config.refresh_period + REFRESH_SLACK_S
            self.models = SwarmModels(
                self.swarm, self.known_models, record_ttl=ttl, serving=config.serving
            )
            self.models.hear_joins_and_leaves()
            for text in config.initial_peers:
                await self._join(text)
            async with trio.open_nursery() as nursery:
                if config.mdns:
                    nursery.start_soon(join_discovered_peers, node)
                nursery.start_soon(self._reachability_forever, nursery)
                self.models.start(nursery)
                nursery.start_soon(self.swarm.refresh)
                await self.swarm.ready.wait()  # routable, maybe before that refresh ends
                if config.blocks is not None:
                    await self._start_serving(nursery)
                nursery.start_soon(self.swarm.run)
                self.api = self._api()
                socket_path = await nursery.start(self.api.serve)
                if config.metrics_port is not None:
                    await self._serve_metrics(nursery, config.metrics_port)
                self._print_banner(socket_path)
                nursery.start_soon(self._handle_signals, nursery.cancel_scope)

    async def _serve_metrics(self, nursery: trio.Nursery, port: int) -> None:
        from peerd.daemon.metrics import TokenRate, daemon_metrics, sample_tokens, serve_metrics

        rate = TokenRate()
        nursery.start_soon(sample_tokens, self, rate)
        bound = await nursery.start(serve_metrics, port, lambda: daemon_metrics(self, rate))
        self.metrics_port = bound

    async def _reachability_forever(self, nursery: trio.Nursery) -> None:
        """Learn whether peers can dial us (AutoNAT, or --reachability), then keep relay
        reservations while we cannot be dialled."""
        assert self.node is not None
        node = self.node
        fixed = self.config.reachability
        if fixed != "auto":
            await node.set_reachability(Reachability(fixed))
        while True:
            if fixed == "auto":
                await node.check_reachability()
            await node.keep_reservations(nursery)
            decided = node.reachability is not Reachability.UNKNOWN
            if node.reachability is Reachability.PRIVATE:
                # Behind NAT: re-check reservations often; relays come and go.
                await trio.sleep(min(self.config.refresh_period, REACHABILITY_FIRST_CHECKS_S * 5))
            else:
                await trio.sleep(REACHABILITY_RECHECK_S if decided else REACHABILITY_FIRST_CHECKS_S)

    async def _join(self, text: str) -> None:
        assert self.node is not None
        peer = parse_peer_maddr(text)
        try:
            with trio.fail_after(10):
                await self.node.connect(peer)
        except Exception as e:
            log.warning("could not reach initial peer %s: %s", text, e)

    async def _start_serving(self, nursery: trio.Nursery) -> None:
        assert self.node is not None and self.swarm is not None
        config = self.config
        kind, a, b = self.blocks_spec
        if kind == "span":
            assert a is not None and b is not None
            start, end = a, b
        else:
            count = a if kind == "count" else self._blocks_that_fit()
            assert count is not None
            start, end = choose_blocks(self.swarm.snapshot(), count, own_throughput=1.0)
        log.info("serving blocks %d:%d of %s", start, end, self.model)
        server = BlockServer(
            model=self.model,
            start=start,
            end=end,
            compute=self.compute,
            peer_id=self.node.peer_id.to_string(),
            addrs=self.node.maddrs,
            limits=config.limits,
            record_ttl=2 * config.refresh_period,
            node=self.node,
            adapters=tuple(a.name for a in self.adapters),
            batching=config.batching,
            swarm_name=config.swarm_name,
            public_name=config.public_name,
            priority=config.priority,
        )
        self.server = server
        nursery.start_soon(watch_standing, server.standing, self.swarm)
        self.swarm.local_server = server
        self.node.host.set_stream_handler(INFO_PROTOCOL, server.handle_info)
        # Announce while joining, so servers starting after us pick other blocks.
        nursery.start_soon(self._announce_forever)
        await self._load_and_go_online(start, end)
        self.node.host.set_stream_handler(INFERENCE_PROTOCOL, server.handle_inference)
        self.node.host.set_stream_handler(PUSH_PROTOCOL, server.handle_push)
        self.node.host.set_stream_handler(TRAINING_PROTOCOL, server.handle_training)
        if kind != "span":
            nursery.start_soon(self._rebalance_forever)

    async def _load_and_go_online(self, start: int, end: int) -> None:
        assert self.server is not None
        config = self.config
        span = await load_serving_span(
            self.checkpoint, (start, end), config.serving, self.adapters, config.compile,
            self.budget, config.cache_tokens,
        )  # fmt: skip
        cache = blocks.MemoryCache(budget_tokens=self.config.cache_tokens)
        throughput = await self._throughput(span)
        self.server.go_online(span, cache, throughput)
        log.info("online: blocks %d:%d, %.1f tokens/s", start, end, throughput)
        assert self.swarm is not None
        log.info("told %d peers that we joined", await self.swarm.tell_joined())

    async def _rebalance_forever(self) -> None:
        """A server that chose its own blocks re-checks now and then whether the swarm would
        gain clearly from it serving others (a server left, new ones joined); if so it drains
        its sessions, loads the new blocks and announces them. Jittered, so servers that see
        the same gap do not all move at once."""
        assert self.server is not None and self.swarm is not None
        rng = random.Random()
        deferred = 0  # rechecks this server let another of its span move first
        while True:
            await trio.sleep(recheck_delay(rng, self.config.rebalance_period))
            await self.swarm.refresh()
            snapshot, record = self.swarm.snapshot(), self.server.record()
            target = better_span(snapshot, record)
            if target is None:
                deferred = 0
                continue
            first = first_to_move(snapshot, record, target)
            if first != record.peer_id and deferred < MAX_DEFERRED_MOVES:
                deferred += 1  # its move shows by the next recheck, unless it never makes it
                continue
            deferred = 0
            old = (self.server.start, self.server.end)
            log.info("moving from blocks %d:%d to %d:%d: the swarm needs them more", *old, *target)
            await self.drain()
            self.server.move_to(*target)
            await self.swarm.announce(range(*target))
            await self._load_and_go_online(*target)

    def _blocks_that_fit(self) -> int:
        config = self.config
        device = config.serving.device  # free GPU memory on CUDA, else a share of free RAM
        self.budget = config.memory_budget or blocks.free_memory(device, AUTO_MEMORY_FRACTION)
        return blocks_to_serve(
            self.model_config, self.budget, config.cache_tokens, self.model, config.serving
        )

    async def _throughput(self, span: blocks.Span) -> float:
        if self.config.throughput != "auto":
            return float(self.config.throughput)
        return float((await self.compute.run(0, blocks.measure_throughput, span)).decode_tps)

    async def _announce_forever(self) -> None:
        assert self.swarm is not None and self.server is not None
        while True:
            await self.swarm.announce(range(self.server.start, self.server.end))
            # Provider records live 3 periods (run): one missed announce still leaves one.
            await trio.sleep(self.config.refresh_period * random.uniform(0.9, 1.1))

    def _api(self) -> LocalApi:
        assert self.node is not None
        peer_id = self.node.peer_id.to_string()
        return LocalApi(
            socket_path=self.config.socket_path(),
            get_generator=self.generator,
            models=self.generator,
            status=lambda: build_status(
                peer_id=peer_id,
                started_at=self.started_at,
                server=self.server,
                swarm=self.swarm,
                models=self.models.listing() if self.models else (),
            ),
            welcome=lambda: wire.Welcome(
                version=__version__,
                peer_id=peer_id,
                model=self.model,
                num_blocks=self.num_blocks,
                hidden_size=int(self.model_config.hidden_size),
            ),
        )

    async def generator(self, model: str | None = None) -> Generator:
        """The client side (embeddings, LM head, tokenizer) of `model` (None: ours), loaded on
        first use: a server that no local program talks to never holds it."""
        assert self.models is not None
        return await self.models.generator(model)

    def _print_banner(self, socket_path: Path) -> None:
        assert self.node is not None
        lines = [f"peerd {__version__}: peer {self.node.peer_id.to_string()}"]
        if self.server is not None:
            lines.append(f"serving blocks {self.server.start}:{self.server.end} of {self.model}")
            if self.server.adapters:
                lines.append(f"adapters {', '.join(self.server.adapters)}")
        lines.append(f"local API socket {socket_path}")
        if self.metrics_port is not None:
            lines.append(f"metrics on http://127.0.0.1:{self.metrics_port}/metrics")
        lines += [f"listening on {addr}" for addr in self.node.maddrs()]
        lines.append(join_command(self.config, self.node.maddrs()))
        print("\n".join(lines), flush=True)

    async def _handle_signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: draining", signal.Signals(signum).name)
                if self.server is not None and self.swarm is not None:
                    log.info("told %d peers that we leave", await self.swarm.tell_leaving())
                await self.drain()
                scope.cancel()
                return

    async def drain(self) -> None:
        """Stop taking sessions, tell the swarm (our record says draining), and give open
        sessions a deadline to finish."""
        if self.server is None:
            return
        self.server.drain()
        with trio.move_on_after(self.config.drain_deadline):
            while self.server.open_sessions:
                await trio.sleep(0.1)
        # Past the deadline: end the rest (their clients fail over to other servers).
        self.server.end_sessions()
        with trio.move_on_after(5):
            while self.server.open_sessions:
                await trio.sleep(0.05)


def join_command(config: DaemonConfig, maddrs: list[str]) -> str:
    """The banner's line with the command another machine joins this swarm with: through our
    best address (peerd.node.addresses puts it first), with our model and swarm name."""
    import shlex

    direct = [a for a in maddrs if "/p2p-circuit" not in a] or maddrs
    args = ["peerd", "start", "--initial-peers", direct[0] if direct else "ADDRESS"]
    if config.model != "default":
        args += ["--model", config.model]
    if config.swarm_name:
        args += ["--swarm", config.swarm_name]
    return f"join from another machine: {shlex.join(args)}"


def run(config: DaemonConfig) -> None:
    """Run a daemon until SIGINT/SIGTERM, after the checks that need no model: a clash is
    refused before the weights load. An expected failure (peerd.daemon.startup), however deep in
    the daemon's nurseries, becomes one DaemonError: a line for the user, not a traceback."""
    try:
        with claim_machine(
            config.socket_path(), config.identity, config.initial_peers, config.listen_addrs()
        ) as held:
            trio.run(Daemon(config, held.key_pair).run)
    except BaseException as e:
        cause = sole_cause(e)
        if isinstance(cause, (DaemonError, *EXPECTED_FAILURES)):
            raise DaemonError(str(cause)) from None
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise
