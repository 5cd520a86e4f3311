"""The gateway's hold on the local daemon: the models it can generate with (name, tokenizer,
context length), connections to it through peerd.sdk.client.AsyncClient, and one generation as a
stream of text pieces.

Several models: the daemon's own is the gateway's default (also called "default"); another model
of the swarm is offered when the daemon lists it with a checkpoint it can load and every block of
it is served (docs/gateway.md#several-models). A requested name is checked (routing.models)
before anything is looked up by it; the tokenizer loads from the directory the daemon reports,
never from a path a request gave.

Every API of the gateway is a translation onto `DaemonLink.generate`; errors become
`GatewayError`, which each API renders in its own shape.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio

import wire
from peerd.sdk.client import AsyncClient, GenerateOptions, PeerdError
from routing.models import is_model_name
from routing.planner import NoRouteError
from routing.records import SwarmSnapshot, contiguous_ranges, info_to_record
from wire.local_api import MAX_SWARM_MODELS
from wire.peer_protocol import DEFAULT_SESSIONS_PER_PEER, MAX_SESSION_TOKENS

SESSION_SLOTS = DEFAULT_SESSIONS_PER_PEER
"""Generations and v2 sessions in flight at once. Each holds an inference session on every server
of its route, all opened by our one daemon, and a server takes at most this many sessions from one
peer: one more is refused, and the refusal makes the daemon ban that server for a while (for all
its clients). So the gateway queues beyond this instead of failing everyone."""

SLOT_WAIT_S = 120.0
"""How long a request waits in that queue before it gets 503: a couple of long answers' time."""

DEFAULT_MODEL = "default"


class GatewayError(Exception):
    """A request the gateway refuses or could not serve: `status` is the HTTP status, `code` a
    short machine-readable reason, `param` the request field at fault (if one is)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param

    @property
    def message(self) -> str:
        return str(self)


# Daemon error codes -> HTTP status.
_DAEMON_STATUS: dict[str, int] = {
    wire.ErrorCode.BAD_REQUEST: 400,
    wire.ErrorCode.OUT_OF_CACHE: 400,
    wire.ErrorCode.UNSUPPORTED: 404,
    wire.ErrorCode.ADAPTER_NOT_FOUND: 404,
    wire.ErrorCode.NO_ROUTE: 503,
    wire.ErrorCode.INFERENCE_FAILED: 503,
    wire.ErrorCode.BUSY: 503,
    wire.ErrorCode.NO_DAEMON: 503,
    wire.ErrorCode.CONNECTION_CLOSED: 503,
}


def daemon_error(error: PeerdError) -> GatewayError:
    # OpenAI's clients know a prompt too long for the context by this code.
    out_of_cache = error.code == wire.ErrorCode.OUT_OF_CACHE
    code = "context_length_exceeded" if out_of_cache else error.code
    return GatewayError(_DAEMON_STATUS.get(error.code, 500), code, str(error))


# How to pick tokens and when to stop: the client library's options, one definition for all.
Sampling = GenerateOptions


@dataclass(frozen=True)
class Piece:
    """New text of a generation, and how many tokens it took (a token may decode to no text on
    its own, half a UTF-8 character say, and then counts with the next piece)."""

    text: str
    tokens: int


@dataclass(frozen=True)
class Done:
    """The generation ended: `reason` is length, stop, eos or cancelled; `tokens` counts the
    tokens no Piece reported (an end-of-sequence token, say); `total` all the tokens sampled."""

    reason: str
    tokens: int
    total: int


@dataclass
class ModelFacts:
    """A model the gateway generates with (the daemon's own, or another of the swarm), as it
    needs it."""

    name: str
    num_blocks: int
    context_length: int
    tokenizer: Any
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def accepts(self, requested: str | None) -> bool:
        return requested in (None, "", DEFAULT_MODEL, self.name)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:  # a fast tokenizer may not be called from two threads at once
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        with self._lock:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await anyio.to_thread.run_sync(self._encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of a conversation in the model's chat template, ready for its answer
        (exactly what the daemon feeds for a chat turn)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise GatewayError(
                400,
                "no_chat_template",
                f"{self.name} has no chat template: send plain text to /v1/completions",
            )
        return await anyio.to_thread.run_sync(self._encode_chat, messages)

    def check_room(
        self, prompt_tokens: int, max_new_tokens: int, *, param: str = "max_new_tokens"
    ) -> None:
        if prompt_tokens + max_new_tokens > self.context_length:
            raise GatewayError(
                400,
                "context_length_exceeded",
                f"the prompt is {prompt_tokens} tokens and asks for {max_new_tokens} more, but "
                f"{self.name} reads at most {self.context_length} tokens: shorten the prompt or "
                f"ask for fewer new tokens",
                param,
            )


class DaemonLink:
    """The daemon on `socket_path`, as every request of one gateway sees it."""

    def __init__(self, socket_path: str | Path | None, checkpoint: str | Path | None = None):
        self.socket_path = socket_path
        self.checkpoint = checkpoint
        self._facts: ModelFacts | None = None
        self._other_facts: dict[str, ModelFacts] = {}  # the swarm's other models, by name
        self._facts_lock = anyio.Lock()
        self._slots = anyio.Semaphore(SESSION_SLOTS)
        self.generations_in_flight = 0

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[AsyncClient]:
        """A fresh connection to the daemon (one per request: the daemon runs one request at a
        time per connection, and closing it frees whatever sessions it opened)."""
        client = AsyncClient(self.socket_path)
        try:
            await client.connect()
        except PeerdError as e:
            raise daemon_error(e) from e
        try:
            yield client
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()

    @asynccontextmanager
    async def session_slot(self) -> AsyncIterator[None]:
        """Wait for one of SESSION_SLOTS; 503 after SLOT_WAIT_S."""
        acquired = False
        with anyio.move_on_after(SLOT_WAIT_S):
            await self._slots.acquire()
            acquired = True
        if not acquired:
            raise GatewayError(
                503,
                "busy",
                f"all {SESSION_SLOTS} generation slots of this gateway stayed busy for "
                f"{SLOT_WAIT_S:.0f} s: try again shortly",
            )
        self.generations_in_flight += 1
        try:
            yield
        finally:
            self.generations_in_flight -= 1
            self._slots.release()

    async def generate(
        self, sampling: Sampling, model: ModelFacts | None = None, **request: Any
    ) -> AsyncGenerator[Piece | Done, None]:
        """run_generation (with `model`, else the daemon's own) on a connection of its own,
        holding a session slot throughout."""
        if model is not None:
            sampling = dataclasses.replace(sampling, model=model.name)
        async with (
            self.session_slot(),
            self.connect() as client,
            aclosing(run_generation(client, sampling, **request)) as events,
        ):
            async for item in events:
                yield item

    async def model(self, requested: str | None = None, param: str = "model") -> ModelFacts:
        """The model a request names (None, "" or "default": the daemon's own), learnt on first
        use (each tokenizer loads once); 404 naming the models there are for any other name."""
        async with self._facts_lock:
            if self._facts is None:
                async with self.connect() as client:
                    welcome = client.welcome
                    listed = await _listed_models(client)
                assert welcome is not None
                # Where the daemon loads its model from (it says so since it lists the swarm's
                # models), else --model DIR, else the name (the default model's resolves).
                own = next((m.checkpoint for m in listed if m.name == welcome.model), "")
                source = self.checkpoint or own or welcome.model
                self._facts = await anyio.to_thread.run_sync(
                    _load_facts, welcome.model, welcome.num_blocks, source
                )
            if self._facts.accepts(requested):
                return self._facts
            assert requested is not None
            if (facts := self._other_facts.get(requested)) is None:
                facts = await self._load_other(requested, param)
            return facts

    async def _load_other(self, requested: str, param: str) -> ModelFacts:
        """Another model of the swarm, if the daemon can generate with it (caller holds the
        lock); its tokenizer loads from the checkpoint directory the daemon reports."""
        assert self._facts is not None
        own = self._facts.name
        listed = await self.swarm_models()
        entry = next((m for m in listed if m.name == requested), None)
        if entry is None or not is_model_name(requested):
            names = ", ".join([own, *(m.name for m in listed if m.name != own)])
            raise GatewayError(
                404,
                "model_not_found",
                f"no model {requested[:80]!r} here: this gateway serves {names}",
                param,
            )
        facts = await anyio.to_thread.run_sync(
            _load_facts, entry.name, entry.num_blocks, entry.checkpoint
        )
        if len(self._other_facts) < MAX_SWARM_MODELS:
            self._other_facts[entry.name] = facts
        return facts

    async def swarm_models(self) -> list[wire.SwarmModel]:
        """The daemon's other models a request may name: served in full, with a checkpoint the
        daemon (and so this gateway, on the same machine) can load."""
        async with self.connect() as client:
            listed = await _listed_models(client)
        return [
            m for m in listed if m.checkpoint and m.num_blocks and m.blocks_served == m.num_blocks
        ]

    async def model_names(self) -> list[str]:
        """Every model a request may name: the daemon's own first, then the others served in
        full (swarm_models)."""
        own = (await self.model()).name
        return [own, *(m.name for m in await self.swarm_models() if m.name != own)]

    async def swarm_view(self) -> tuple[wire.StatusResponse, SwarmSnapshot]:
        """The daemon's status, and the servers it knows of as a snapshot of its model."""
        facts = await self.model()
        async with self.connect() as client:
            try:
                status = await client.status()
            except PeerdError as e:
                raise daemon_error(e) from e
        records = []
        for info in status.swarm:
            try:
                records.append(info_to_record(info))
            except ValueError:
                continue
        return status, SwarmSnapshot.from_records(facts.name, facts.num_blocks, records)

    async def swarm_status(self) -> dict[str, Any]:
        """What the daemon knows of the swarm, and which blocks no online server holds (with the
        routing layer's own message for it)."""
        facts = await self.model()
        status, snapshot = await self.swarm_view()
        missing = contiguous_ranges(snapshot.uncovered_blocks())
        return {
            "model": facts.name,
            "num_blocks": facts.num_blocks,
            "context_length": facts.context_length,
            "peer_id": status.peer_id,
            "servers": [
                {"peer_id": r.peer_id, "start": r.start, "end": r.end, "state": r.state.value}
                for r in sorted(snapshot.records, key=lambda r: (r.start, r.end, r.peer_id))
            ],
            "missing_blocks": [[a, b] for a, b in missing],
            "message": str(NoRouteError(facts.name, missing, {})) if missing else None,
            "models": [
                {"name": facts.name, "num_blocks": facts.num_blocks},
                *(
                    {"name": m.name, "num_blocks": m.num_blocks}
                    for m in await self.swarm_models()
                    if m.name != facts.name
                ),
            ],
            "generations_in_flight": self.generations_in_flight,
            "generation_slots": SESSION_SLOTS,
        }


async def _listed_models(client: AsyncClient) -> list[wire.SwarmModel]:
    try:
        return await client.models()
    except PeerdError as e:
        raise daemon_error(e) from e


def _load_facts(name: str, num_blocks: int, source: str | Path) -> ModelFacts:
    """A model's tokenizer and context length, from its checkpoint (`source`)."""
    from transformers import AutoTokenizer

    import blocks
    from blocks.checkpoint import load_config

    try:
        path = blocks.resolve_checkpoint(source)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config = load_config(path)
    except (OSError, ValueError, blocks.BlocksError) as e:
        raise GatewayError(
            503,
            "model_not_found",
            f"the daemon runs {name}, whose tokenizer this gateway cannot load "
            f"({e}): give the checkpoint directory with `peerd gateway --model DIR`",
        ) from e
    context = getattr(config, "max_position_embeddings", None) or tokenizer.model_max_length
    return ModelFacts(
        name=name,
        num_blocks=num_blocks,
        context_length=int(min(context, MAX_SESSION_TOKENS)),
        tokenizer=tokenizer,
    )


async def run_generation(
    client: AsyncClient,
    sampling: Sampling,
    *,
    input_ids: Sequence[int] | None = None,
    prompt: str | None = None,
    chat: bool = False,
    session: str | None = None,
) -> AsyncGenerator[Piece | Done, None]:
    """One generation on `client`'s connection, as Pieces then one Done. Closing this iterator
    early cancels the generation on the daemon."""
    unreported = 0
    try:
        tokens = client.stream_tokens(
            prompt,
            input_ids=list(input_ids) if input_ids is not None else None,
            chat=chat,
            session=session,
            options=sampling,
        )
        async with aclosing(cast(AsyncGenerator[wire.Message, None], tokens)):
            async for message in tokens:
                if isinstance(message, wire.GenerateDone):
                    yield Done(message.reason, unreported, message.token_count)
                    return
                unreported += 1
                if message.text:
                    yield Piece(message.text, unreported)
                    unreported = 0
    except PeerdError as e:
        raise daemon_error(e) from e
