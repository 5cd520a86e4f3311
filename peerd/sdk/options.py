"""What a program sets on its requests: routing controls, sampling and stopping, the socket, and
the local API requests built from them (refused here, before anything is sent, when malformed)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import wire
from peerd.paths import default_socket_path
from peerd.sdk.errors import BadRouteOptions, PeerdError

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a client waits for the daemon to connect, take a message or send the next one."""


def socket_path(path: str | Path | None) -> Path:
    """The daemon's socket: `path` when given, else $PEERD_SOCKET, else the per-user default."""
    if path is not None:
        return Path(path)
    if env := os.environ.get("PEERD_SOCKET"):
        return Path(env)
    return default_socket_path()


def route_options(
    *,
    allowed_servers: Iterable[str] | None = None,
    blocked_servers: Iterable[str] = (),
    max_retries: int | None = None,
    connect_timeout: float | None = None,
    request_timeout: float | None = None,
) -> wire.RouteOptions | None:
    """Routing controls for the daemon (None when all are the defaults).

    allowed_servers: use only these peers (ids as `peerd status` shows them); blocked_servers:
    never use these; max_retries: failed servers to replace before failing; connect_timeout:
    seconds to dial a hop and open its session; request_timeout: seconds each step may take.
    Raises BadRouteOptions naming a malformed peer id.
    """
    if isinstance(allowed_servers, str) or isinstance(blocked_servers, str):
        raise BadRouteOptions("allowed_servers and blocked_servers take a list of peer ids")
    try:
        options = wire.RouteOptions(
            allowed_servers=None if allowed_servers is None else tuple(allowed_servers),
            blocked_servers=tuple(blocked_servers),
            max_retries=max_retries,
            connect_timeout=None if connect_timeout is None else float(connect_timeout),
            request_timeout=None if request_timeout is None else float(request_timeout),
        )
    except (wire.ProtocolError, ValueError, TypeError) as e:
        raise BadRouteOptions(str(e)) from e
    return None if options == wire.RouteOptions() else options


def print_route(route: Iterable[str], out: Any = None) -> None:
    """The route a generation or session used, as show_route prints it (to stderr)."""
    print("route: " + (" -> ".join(route) or "(none)"), file=out or sys.stderr, flush=True)


class RouteControls:
    """What every client holds: the routing controls it sends with each request, and the route
    the last generation or session used."""

    def __init__(self, show_route: bool, routing: Mapping[str, Any]) -> None:
        self.routing = route_options(**routing)
        self.show_route = show_route
        self.last_route: tuple[str, ...] = ()

    def _route_used(self, route: tuple[str, ...]) -> None:
        self.last_route = route
        if self.show_route:
            print_route(route)


@dataclass
class GenerateOptions:
    """Sampling and stopping settings of one generation, as a program or the command line gives
    them; `sampling` is the wire record the daemon's sampler takes."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    active_adapter: str | None = None  # a LoRA adapter the servers apply (None: the base model)
    model: str | None = None  # a model of the swarm, by name (Client.models()); None: the daemon's
    # Speculative decoding: "auto", "ngram", "draft:PATH" (a checkpoint on the daemon's machine
    # with the model's tokenizer) or "off"; the same output, fewer passes through the swarm.
    speculate: str = "off"
    speculate_tokens: int | None = None  # drafts per pass (auto: the most); None: the default

    @classmethod
    def merged(cls, options: GenerateOptions | None, changes: Mapping[str, Any]) -> GenerateOptions:
        """`options` (or the defaults) with keyword arguments of a client call laid over them."""
        return dataclasses.replace(options or cls(), **changes)

    @property
    def sampling(self) -> wire.Sampling:
        """How the daemon picks each token. Sampling settings are dropped for greedy decoding,
        so a caller's temperature=0 ("greedy") is not an error. Raises PeerdError(bad_request)."""
        try:
            if not self.do_sample:
                return wire.Sampling(repetition_penalty=self.repetition_penalty, seed=self.seed)
            return wire.Sampling(
                do_sample=True,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                repetition_penalty=self.repetition_penalty,
                seed=self.seed,
            )
        except (wire.ProtocolError, ValueError, TypeError) as e:
            raise PeerdError(wire.ErrorCode.BAD_REQUEST, str(e)) from e

    def options(self) -> dict[str, Any]:
        """These settings as keyword arguments of a client call (greedy: sampling ones reset)."""
        fields = dataclasses.asdict(self) | {"stop": tuple(self.stop)}
        if not self.do_sample:
            fields.update(temperature=1.0, top_k=None, top_p=None)
        return fields


@dataclass
class Generation:
    """What one finished generation gave."""

    text: str
    token_ids: list[int]
    reason: str


def generate_request(
    prompt: str | list[str] | None,
    input_ids: list[int] | None,
    chat: bool,
    session_id: str | None,
    options: GenerateOptions,
    routing: wire.RouteOptions | None = None,
) -> wire.Generate:
    """The Generate message for one call (a list of prompts is a batch). Raises PeerdError."""
    try:
        return wire.Generate(
            prompt=prompt if isinstance(prompt, str) else None,
            prompts=tuple(prompt) if isinstance(prompt, list | tuple) else None,
            input_ids=tuple(input_ids) if input_ids is not None else None,
            max_new_tokens=options.max_new_tokens,
            sampling=options.sampling,
            stop=tuple(options.stop),
            chat=chat,
            session_id=session_id,
            active_adapter=options.active_adapter,
            routing=routing,
            model=options.model,
            speculate=options.speculate,
            speculate_tokens=options.speculate_tokens,
        )
    except (wire.ProtocolError, ValueError, TypeError) as e:
        raise PeerdError(wire.ErrorCode.BAD_REQUEST, str(e)) from e


def open_request(
    max_length: int,
    batch_size: int,
    active_adapter: str | None,
    routing: wire.RouteOptions | None = None,
    left_padding: tuple[int, ...] = (),
    model: str | None = None,
) -> wire.OpenInference:
    """The OpenInference message for one session. Raises PeerdError."""
    try:
        return wire.OpenInference(
            max_length=max_length,
            batch_size=batch_size,
            active_adapter=active_adapter,
            routing=routing,
            left_padding=tuple(left_padding),
            model=model,
        )
    except (wire.ProtocolError, ValueError, TypeError) as e:
        raise PeerdError(wire.ErrorCode.BAD_REQUEST, str(e)) from e
