"""Several models in one swarm: which models the swarm serves, which of them this daemon can load
the client side of, and one swarm view and one generator per model a local program used.

How a daemon learns the swarm's models (docs/swarm.md#several-models): every server provides the
swarm-wide models key besides its model's keys, and a swarm view's refresh asks the providers of
that key (and the DHT peers it knows) for their live records; every record of our swarm, of any
model, is heard here (`hear`). A name from a record, a local program or a web page is checked
(routing.models) before anything is looked up by it.

What a daemon may load: the client side (embeddings, LM head, tokenizer) of its own `--model`
and of the checkpoints its operator named with `--client-models` ('default' by default), never
a path or id that came over a socket or the network. A model the swarm serves but this daemon
has no checkpoint of is refused with the flag that fixes it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import trio
from libp2p.peer.id import ID

import blocks
import wire
from blocks.checkpoint import DEFAULT_MODEL
from blocks.default_model import NAME as DEFAULT_NAME
from peerd.daemon.api_session import ApiError
from peerd.node import compute_thread
from peerd.node.p2p import JOINED_PROTOCOL, LEAVING_PROTOCOL
from peerd.session.generation import Generator
from peerd.session.swarm import SwarmView
from routing.models import BadModelName, check_model_name, is_model_name
from routing.records import ServerRecord, SwarmSnapshot
from wire.local_api import MAX_SWARM_MODELS, MAX_SWARM_RECORDS

log = logging.getLogger(__name__)


class ModelSetupError(Exception):
    """A --client-models entry this daemon cannot use; the message says what to give."""


def known_checkpoints(primary: str, primary_path: Path, sources: Sequence[str]) -> dict[str, str]:
    """Model name -> what to resolve it from, for our own model and each --client-models entry.
    'default' stays unresolved (its first use converts it); a directory or hub id is resolved
    now, so a wrong one stops the daemon before it joins."""
    known = {primary: str(primary_path)}
    for source in sources:
        if source in (DEFAULT_MODEL, DEFAULT_NAME):
            known.setdefault(DEFAULT_NAME, DEFAULT_MODEL)
            continue
        try:
            path = blocks.resolve_checkpoint(source)
        except blocks.BlocksError as e:
            raise ModelSetupError(f"--client-models {source}: {e}") from None
        known.setdefault(blocks.model_name(path), str(path))
    return known


class SwarmModels:
    """The models of the swarm as this daemon knows them, and the views and generators of the
    ones local programs use (the daemon's own model's view is made by the daemon)."""

    def __init__(
        self,
        primary: SwarmView,
        checkpoints: dict[str, str],
        *,
        record_ttl: float,
        serving: blocks.Serving | None = None,
    ) -> None:
        # The client sides (embeddings, LM head) run on the daemon's --device in its --dtype.
        self.serving = serving or blocks.Serving()
        self.primary = primary.model
        self.views: dict[str, SwarmView] = {primary.model: primary}
        self.checkpoints = checkpoints  # model name -> checkpoint (known_checkpoints)
        self.num_blocks: dict[str, int] = {primary.model: primary.num_blocks}
        self.paths: dict[str, Path] = {primary.model: Path(checkpoints[primary.model])}
        self._preparing: set[str] = set()  # models whose block count is being (or was) learnt
        self.heard: dict[str, dict[str, ServerRecord]] = {}  # model -> peer id -> record
        self.record_ttl = record_ttl
        self._primary_view = primary
        self._generators: dict[str, Generator] = {}
        self._lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        primary.on_record = self.hear

    def hear_joins_and_leaves(self) -> None:
        """Take the joined/leaving streams peers open to us: a server that joined is asked for
        its record by our own model's view (its record, of any model, is heard here); one that
        leaves is out of every view, and of what we heard, at once."""
        node = self._primary_view.node
        node.on_told(JOINED_PROTOCOL, self._heard_join_from)
        node.on_told(LEAVING_PROTOCOL, self._heard_leave_from)

    async def _heard_join_from(self, peer: ID) -> None:
        await self._primary_view.heard_join(peer.to_string())

    async def _heard_leave_from(self, peer: ID) -> None:
        self.heard_leave(peer.to_string())

    def heard_leave(self, peer_id: str) -> None:
        """The server `peer_id` (the authenticated peer of the stream) is going."""
        for view in list(self.views.values()):
            view.heard_leave(peer_id)
        for records in self.heard.values():
            records.pop(peer_id, None)

    def start(self, nursery: trio.Nursery) -> None:
        """Views made from now on refresh in `nursery` (the daemon's)."""
        self._nursery = nursery

    # --- what the swarm serves ----------------------------------------------------------------

    def hear(self, record: ServerRecord) -> None:
        """A peer of our swarm answered with its record: remember which model it serves. A
        name that is not a model name, or a model past MAX_SWARM_MODELS, is ignored."""
        if not is_model_name(record.model):
            return
        now = time.time()
        records = self.heard.get(record.model)
        if records is None:
            self._forget_expired(now)
            if len(self.heard) >= MAX_SWARM_MODELS:
                return
            records = self.heard[record.model] = {}
        if record.peer_id not in records and len(records) >= MAX_SWARM_RECORDS:
            return
        self._prepare_soon(record.model)
        for model, others in self.heard.items():  # a server restarted with another model
            if model != record.model:
                others.pop(record.peer_id, None)
        expires_at = now + self.record_ttl
        records[record.peer_id] = dataclasses.replace(record, updated_at=now, expires_at=expires_at)

    def _prepare_soon(self, model: str) -> None:
        loadable = model in self.checkpoints and model not in self.paths
        if loadable and model not in self._preparing and self._nursery is not None:
            self._preparing.add(model)
            self._nursery.start_soon(self.prepare, model)

    def _forget_expired(self, now: float) -> None:
        for model in list(self.heard):
            records = self.heard[model]
            for peer_id in [p for p, r in records.items() if r.is_expired(now)]:
                del records[peer_id]
            if not records:
                del self.heard[model]

    def servers(self, model: str) -> list[ServerRecord]:
        """The servers of `model` we know of: its view's, else the records heard."""
        if (view := self.views.get(model)) is not None:
            return list(view.records.values())
        now = time.time()
        return [r for r in self.heard.get(model, {}).values() if not r.is_expired(now)]

    def served(self) -> list[str]:
        """Models some server we know of serves, ours first."""
        names = {m for m in self.views if self.servers(m)} | {
            m for m in self.heard if self.servers(m)
        }
        return sorted(names, key=lambda m: (m != self.primary, m))

    def listing(self) -> tuple[wire.SwarmModel, ...]:
        """Every model served in the swarm, and every one this daemon can load (ours first)."""
        names = self.served()
        names += sorted(m for m in self.checkpoints if m not in names)
        return tuple(self._describe(m) for m in names[:MAX_SWARM_MODELS])

    def _describe(self, model: str) -> wire.SwarmModel:
        records = self.servers(model)
        num_blocks = self.num_blocks.get(model, 0)
        served = 0
        if num_blocks:
            snapshot = SwarmSnapshot.from_records(model, num_blocks, records, now=time.time())
            served = num_blocks - len(snapshot.uncovered_blocks())
        return wire.SwarmModel(
            name=model,
            servers=len(records),
            num_blocks=num_blocks,
            blocks_served=served,
            checkpoint=str(self.paths.get(model) or self.checkpoints.get(model, "")),
        )

    # --- using one ----------------------------------------------------------------------------

    def choose(self, requested: str | None) -> str:
        """The model a request names (None: ours; 'default': the default model), or ApiError
        saying which models there are and how to use one this daemon has no checkpoint of."""
        if requested is None:
            return self.primary
        if requested in (DEFAULT_MODEL, DEFAULT_NAME):
            requested = DEFAULT_NAME
        try:
            name = check_model_name(requested)
        except BadModelName as e:
            raise ApiError(wire.ErrorCode.BAD_REQUEST, str(e)) from None
        if name in self.checkpoints:
            return name
        served = ", ".join(self.served()) or "none that this daemon knows of yet"
        loadable = ", ".join(sorted(self.checkpoints))
        if name in self.heard:
            raise ApiError(
                wire.ErrorCode.UNSUPPORTED,
                f"{name} is served in the swarm, but this daemon has no checkpoint of it: "
                f"restart it with `--client-models DIR` (the checkpoint directory of {name}); "
                f"it can generate with {loadable}",
            )
        raise ApiError(
            wire.ErrorCode.UNSUPPORTED,
            f"no model {name!r} here: the swarm serves {served}; this daemon can generate with "
            f"{loadable} (`peerd status` lists the models)",
        )

    async def generator(self, requested: str | None) -> Generator:
        """The generator of the model a request names: its client side loaded and its swarm
        view refreshed on first use (a server nobody generates through never holds them)."""
        model = self.choose(requested)
        async with self._lock:
            if (generator := self._generators.get(model)) is None:
                try:
                    path = await self._resolve(model)
                    on = self.serving
                    load = blocks.load_client_side
                    client = await compute_thread.run(load, path, on.dtype, on.device)
                except (OSError, ValueError, blocks.BlocksError) as e:
                    raise ApiError(
                        wire.ErrorCode.UNSUPPORTED,
                        f"this daemon cannot load {model} from {self.checkpoints[model]}: {e}",
                    ) from e
                generator = Generator(client, await self._view(model))
                self._generators[model] = generator
            return generator

    async def _resolve(self, model: str) -> Path:
        if (path := self.paths.get(model)) is None:
            source = self.checkpoints[model]
            path = await trio.to_thread.run_sync(blocks.resolve_checkpoint, source)
            config = await trio.to_thread.run_sync(blocks.load_config, path)
            self.num_blocks[model] = int(config.num_hidden_layers)
            self.paths[model] = path
        return path

    async def _view(self, model: str) -> SwarmView:
        if (view := self.views.get(model)) is None:
            like = self._primary_view
            view = SwarmView(
                like.node,
                model,
                self.num_blocks[model],
                refresh_period=like.refresh_period,
                swarm_name=like.swarm_name,
            )
            view.verify_fraction = like.verify_fraction
            view.pipeline_prompts = like.pipeline_prompts
            view.directory.board = like.directory.board
            view.on_record = self.hear
            # What we heard is live records (each answered an info call within record_ttl):
            # route by them at once; the view's own refreshes take over in the background.
            view.records = {r.peer_id: r for r in self.servers(model)}
            if not view.records:  # none heard of yet: look them up before the first route
                try:
                    await view.refresh()
                except Exception as e:  # as SwarmView.run: the next refresh tries again
                    log.warning("looking up the servers of %s failed: %s", model, e)
            self.views[model] = view
            if self._nursery is not None:
                self._nursery.start_soon(view.run)
            log.info("following the servers of %s too (%d blocks)", model, view.num_blocks)
        return view

    async def prepare(self, model: str) -> None:
        """Learn the block count of `model`, one we can load, for its coverage in `listing`
        (converting the default model once if need be). Done in the background when the swarm
        is first heard serving it: a daemon whose swarm never serves it never reads it."""
        try:
            await self._resolve(model)
        except (OSError, ValueError, blocks.BlocksError) as e:
            log.warning("cannot read the checkpoint of %s: %s", model, e)
