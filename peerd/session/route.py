"""Route keeping for one inference session: open a session on every hop of a route, and when a
hop fails, ban its server, open replacement hops over the same blocks and replay the remembered
inputs to rebuild their caches.

The keeper remembers every input sent into each block boundary (`inputs`), so any hop can be
rebuilt elsewhere; the step runner (peerd.session.steps) tells it what each hop took.

A hop whose failure may be another server's doing (hops.Unattributed: a step pushed into it
went wrong) is moved without banning anyone, and the session stops pushing: from then on every
step goes through us, where each hop's output is checked before the next hop sees it, and no
hop opened since takes pushes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

import torch
import trio

import wire
from peerd.session.hops import (
    PEER_FAULTS,
    FirstStep,
    Hop,
    HopOptions,
    HopRefused,
    LeaseLapsed,
    Unattributed,
    open_hop,
    session_request,
)
from peerd.session.swarm import SwarmView
from routing.planner import NoRouteError, Route, RouteHop, plan_route

log = logging.getLogger(__name__)

# How long to wait for the swarm to offer a route (servers may be restarting) before failing.
ROUTE_WAIT_S = 30.0
# Seconds past that deadline a refresh under way may take to finish (one info round trip).
INFO_GRACE_S = 3.0
# Failed servers one session replaces before it gives up (RouteOptions.max_retries overrides it).
MAX_HOP_FAILURES = 8


class InferenceFailed(Exception):
    """The swarm could not finish a step: no server is left for some blocks, or too many failed."""


class AdapterUnavailable(InferenceFailed):
    """No server in the swarm offers the LoRA adapter a session asked for."""


class _OpenFailed(Exception):
    """Opening a route failed at hop `index` with a peer's fault, `error`."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index, self.error = index, error


class RouteKeeper:
    """The open hops of one session's route, the inputs each block boundary took, and the
    servers' failures so far."""

    def __init__(
        self,
        swarm: SwarmView,
        options: HopOptions,
        *,
        allowed: frozenset[str] | None,
        blocked: frozenset[str],
        max_retries: int,
    ) -> None:
        self.swarm = swarm
        self.options = options
        self.allowed, self.blocked = allowed, blocked
        self.max_retries = max_retries
        self.hops: list[Hop] = []
        # inputs[b]: every hidden state sent into block b so far, concatenated over positions.
        self.inputs: dict[int, torch.Tensor] = {}
        self._buffers: dict[int, tuple[torch.Tensor, int]] = {}  # block -> (storage, written)
        self.failures = 0
        self.unattributed = 0  # hops moved for faults that may not be their server's
        self.lapsed = 0  # hops moved because their server took back an idle session's cache
        self.pushing = True  # False once a pushed step went wrong: relay every step
        self.step_ids = itertools.count()  # one counter for every step of the session
        self._reported: Hop | None = None  # the hop being replaced (already counted as failed)
        # Opening waits for the first step (open_with): the route planned meanwhile.
        self.deferred = False
        self.planned: Route = ()

    async def open(self, defer: bool = False) -> None:
        """Open a route over every block (after checking some server offers our adapter);
        `defer`: only wait until one can be planned, and open it with the first step
        (open_with)."""
        if self.options.adapter is not None:
            await self._check_adapter_offered(self.options.adapter)
        if not defer:
            self.hops = await self.open_hops(0, self.swarm.num_blocks)
            return
        deadline, route = trio.current_time() + ROUTE_WAIT_S, None
        while route is None:
            route = await self._plan(0, self.swarm.num_blocks, set(), deadline)
        self.planned, self.deferred = route, True

    async def open_with(self, first: FirstStep | None) -> None:
        """Open the deferred route, sending `first` with it where it can go (FirstStep)."""
        self.hops = await self.open_hops(0, self.swarm.num_blocks, first=first)
        self.deferred, self.planned = False, ()

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            for hop in self.hops:
                await hop.close()
        self.hops = []

    async def open_hop(
        self,
        hop: RouteHop,
        upstream: str | None = None,
        *,
        request: wire.OpenSession | None = None,
        first_step: wire.Step | None = None,
    ) -> Hop:
        """A session on one server with this route's options, taking pushes from `upstream`
        alone (the verifier opens its own, which nobody pushes into); see hops.open_hop."""
        return await open_hop(
            self.swarm,
            hop,
            self.options,
            self.step_ids,
            upstream,
            request=request,
            first_step=first_step,
        )

    # --- the input history ------------------------------------------------------------------

    def remember(self, block: int, hidden: torch.Tensor) -> None:
        """Append `hidden` to the inputs of block `block`. They live in a buffer that doubles
        when full, so a decode step copies its own row, not the whole history (a torch.cat per
        hop and token allocated the history anew: 0.1-0.6 ms each on the step's path). Only
        past the end of what was ever written there: a view handed out earlier never changes."""
        past = self.inputs.get(block)
        if past is None:
            self.inputs[block] = hidden
            return
        if past.shape[0] != hidden.shape[0] or past.shape[2:] != hidden.shape[2:]:
            self.inputs[block] = torch.cat([past, hidden], dim=1)  # torch.cat's own error
            return
        length, end = past.shape[1], past.shape[1] + hidden.shape[1]
        buffer, written = self._buffers.get(block, (None, 0))
        if not _appendable(past, hidden, buffer, written):
            dtype = torch.promote_types(past.dtype, hidden.dtype)
            buffer = past.new_empty((past.shape[0], 2 * end, *past.shape[2:]), dtype=dtype)
            buffer[:, :length] = past
        assert buffer is not None
        buffer[:, length:end] = hidden
        self._buffers[block] = (buffer, end)
        self.inputs[block] = buffer[:, :end]

    def forget(self, first_block: int, position: int) -> None:
        """Drop the remembered inputs of blocks from `first_block` on, from `position` on."""
        for block in list(self.inputs):
            if block >= first_block:
                if position == 0:
                    del self.inputs[block]
                    self._buffers.pop(block, None)
                else:
                    self.inputs[block] = self.inputs[block][:, :position]

    def truncate(self, position: int) -> None:
        """Keep the inputs of the first `position` tokens only (a rollback, or a step that was
        interrupted after some hops took it)."""
        for block, inputs in self.inputs.items():
            self.inputs[block] = inputs[:, :position]

    # --- replacing a failed hop ---------------------------------------------------------------

    async def replace(self, index: int, error: Exception) -> None:
        """Swap the failed hop at `index` for fresh hops over the same blocks, with their caches
        rebuilt from the remembered inputs."""
        failed = self.hops[index]
        started = time.perf_counter()
        if isinstance(error, LeaseLapsed) and failed is not self._reported:
            self._reported = failed
            self._move_lapsed(failed, error)
            with trio.CancelScope(shield=True):
                await failed.close()
        elif isinstance(error, Unattributed) and failed is not self._reported:
            self._reported = failed
            self._move_unblamed(failed, error)
            with trio.CancelScope(shield=True):
                await failed.close()
        elif failed is not self._reported:  # not already counted by a replace cut short
            self._reported = failed
            self.failures += 1
            log.warning(
                "server %s failed on blocks %d:%d (%s); re-routing",
                failed.peer_id,
                failed.hop.start,
                failed.hop.end,
                error,
            )
            self.swarm.report_failure(failed.peer_id)
            self._check_retries(error)
            with trio.CancelScope(shield=True):
                await failed.close()
        start, end = failed.hop.start, failed.hop.end
        history = self.inputs.get(start)
        upstream = self.hops[index - 1].peer_id if index > 0 and self.pushing else None
        new_hops = await self._open_and_replay(start, end, history, upstream)
        self.hops[index : index + 1] = new_hops
        self._reported = None
        log.info(
            "blocks %d:%d moved from %s to %s: %d tokens replayed in %.2f s",
            start,
            end,
            failed.peer_id,
            ", ".join(h.peer_id for h in new_hops),
            0 if history is None else int(history.shape[1]),
            time.perf_counter() - started,
        )

    async def _open_and_replay(
        self, start: int, end: int, history: torch.Tensor | None, upstream: str | None
    ) -> list[Hop]:
        """Fresh hops over [start, end) with `history` replayed into them, trying other servers
        while replacements die during the replay. The hop after them still names the failed one
        as its upstream, so pushes stop there (StepRunner relays past it)."""
        while True:
            new_hops = await self.open_hops(start, end, upstream)
            try:
                await self._replay(new_hops, start, history)
                return new_hops
            except BaseException as e:
                with trio.CancelScope(shield=True):
                    for hop in new_hops:
                        await hop.close()
                if not isinstance(e, PEER_FAULTS):
                    raise
                # A replacement died while rebuilding its cache (_replay banned it): try others.
                self.failures += 1
                self._check_retries(e)

    def _move_lapsed(self, failed: Hop, error: LeaseLapsed) -> None:
        """Count a hop whose server took back its cache (nobody is banned: a loaded server does
        that to idle sessions); give up once it happened more than max_retries allows."""
        self.lapsed += 1
        log.info(
            "server %s took back the cache of blocks %d:%d (%s); opening the session again",
            failed.peer_id,
            failed.hop.start,
            failed.hop.end,
            error,
        )
        if self.lapsed > self.max_retries:
            raise InferenceFailed(
                f"servers took back this session's cache {self.lapsed} times, more than "
                f"max_retries={self.max_retries} allows (last: {error}). The swarm is short of "
                "cache: retry later, or start a server with free memory"
            ) from error

    def _move_unblamed(self, failed: Hop, error: Unattributed) -> None:
        """Count a hop moved for a fault nobody can be blamed for and stop pushing; give up
        once more such moves happened than max_retries allows."""
        self.unattributed += 1
        self.pushing = False
        log.warning(
            "session on %s (blocks %d:%d) went wrong, maybe by another server's doing (%s); "
            "moving it without blaming anyone and relaying every step from now on",
            failed.peer_id,
            failed.hop.start,
            failed.hop.end,
            error,
        )
        if self.unattributed > self.max_retries:
            raise InferenceFailed(
                f"{self.unattributed} hop(s) of this session went wrong with no server to "
                f"blame, more than max_retries={self.max_retries} allows; giving up (last: "
                f"{error}). Retry, or route around the servers named"
            ) from error

    def _check_retries(self, error: Exception) -> None:
        """Give up once more servers failed than max_retries allows replacing."""
        if self.failures > self.max_retries:
            raise InferenceFailed(
                f"{self.failures} server failure(s) in this session, more than max_retries="
                f"{self.max_retries} allows; giving up (last: {error}). Retry, or allow more "
                "retries"
            ) from error

    async def _replay(self, hops: list[Hop], start: int, history: torch.Tensor | None) -> None:
        """Rebuild the caches of fresh hops over blocks from `start` by running the remembered
        inputs through them, remembering the inputs of any new block boundary on the way."""
        if history is None or history.shape[1] == 0:  # (a cut-back history may be empty)
            return
        hidden = history
        for hop in hops:
            if hop.hop.start != start:
                self.inputs[hop.hop.start] = hidden
            try:
                hidden = await hop.step(hidden, self.options.codec)
            except PEER_FAULTS:
                self.swarm.report_failure(hop.peer_id)
                raise

    # --- opening hops -------------------------------------------------------------------------

    async def open_hops(
        self, start: int, end: int, upstream: str | None = None, first: FirstStep | None = None
    ) -> list[Hop]:
        """Plan [start, end) and open a session on each hop, re-planning around servers that
        refuse or fail to open, until a route opens or no server is left. Each hop takes pushes
        only from the hop before it (the first: from `upstream`). `first` goes with the first
        try only, and only where every hop is remote and takes pushes (FirstStep.sent says).

        A server that fails (unreachable, broken stream) is banned for everyone; one that is
        alive but refuses (full cache, too many sessions from us) is only skipped by this
        session for a moment: it is healthy for other clients and may have room soon."""
        deadline = trio.current_time() + ROUTE_WAIT_S
        refused: set[str] = set()
        while True:
            route = await self._plan(start, end, refused, deadline)
            if route is None:
                continue
            try:
                return await self._open_route(route, upstream, first)
            except _OpenFailed as failed:
                first = None  # the retry opens first, as any route does
                e = failed.error
                bad = route[failed.index].peer_id
                log.warning("could not open a session on %s: %s", bad, e)
                if isinstance(e, HopRefused):
                    refused.add(bad)
                else:
                    self.swarm.report_failure(bad)
                    self.failures += 1
                self._check_retries(e)
                if trio.current_time() > deadline:
                    raise InferenceFailed(
                        f"could not open a route over blocks {start}:{end}: {e}"
                    ) from e

    async def _open_route(
        self, route: Route, upstream: str | None, first: FirstStep | None = None
    ) -> list[Hop]:
        """A session on every hop of `route`, all opened at once (no hop's opening needs
        another's: each names the server before it, known from the route, as its upstream),
        so a route opens in one round trip; with `first`, the first hop's server starts on it
        meanwhile. If any fails, those that opened are closed: an error that is no peer's
        fault (a bug of ours) is raised as itself, else _OpenFailed names the first hop that
        failed."""
        opened: list[Hop | None] = [None] * len(route)
        faults: dict[int, Exception] = {}
        upstreams = [upstream, *(hop.peer_id for hop in route[:-1])]
        requests = [
            session_request(hop, self.options, up if self.pushing else None)
            for hop, up in zip(route, upstreams, strict=True)
        ]
        local = self.swarm.local_server  # its hop is called in process: nothing carries a step
        ours = local is not None and any(hop.peer_id == local.peer_id for hop in route)
        step = first.carried_by(route, requests) if first and self.pushing and not ours else None

        async def open_one(i: int) -> None:
            try:
                opened[i] = await self.open_hop(
                    route[i], request=requests[i], first_step=step if i == 0 else None
                )
            except Exception as e:  # each hop's own: the others finish opening, then close
                faults[i] = e

        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(route)):
                    nursery.start_soon(open_one, i)
        finally:
            if faults or any(hop is None for hop in opened):  # a fault, or cancelled, or a bug
                with trio.CancelScope(shield=True):
                    for hop_session in opened:
                        if hop_session is not None:
                            await hop_session.close()
        bugs = [faults[i] for i in sorted(faults) if not isinstance(faults[i], PEER_FAULTS)]
        if bugs:
            raise bugs[0]
        if faults:
            failed = min(faults)
            raise _OpenFailed(failed, faults[failed])
        if first is not None and step is not None:
            first.sent = True
        return [hop for hop in opened if hop is not None]

    async def _plan(self, start: int, end: int, refused: set[str], deadline: float) -> Route | None:
        """The cheapest route now, or None after waiting a little for the swarm to change
        (InferenceFailed past `deadline`)."""
        try:
            return self.swarm.plan(
                start,
                end,
                min_free_cache_tokens=self.options.batch_size * self.options.max_length,
                session_length=self.options.max_length,
                allowed_servers=self.allowed,
                blocked_servers=refused | self.blocked,
                adapter=self.options.adapter,
            )
        except NoRouteError as e:
            if trio.current_time() > deadline:
                why = explain_unreachable(self.swarm, e.missing)
                raise InferenceFailed(f"{e}; {why}" if why else str(e)) from e
        refused.clear()  # try the busy ones again after a pause
        # A refresh can take long when the DHT nodes are gone (block look-ups time out one by
        # one): wait for a route until the deadline, not for the refresh.
        with trio.move_on_after(max(0.0, deadline - trio.current_time()) + INFO_GRACE_S):
            await self.swarm.refresh()
        self._check_allowed_cover(start, end)
        await trio.sleep(0.5)
        return None

    def _check_allowed_cover(self, start: int, end: int) -> None:
        """Raise NoRouteError at once when the caller's allowed_servers leave some of blocks
        [start, end) to servers outside it: waiting for the swarm cannot fix that. An allowed
        server that failed a request a moment ago is out of the view only until its ban ends
        and a refresh finds it again: while one is banned (not for lying), the caller waits
        for it like for any other, up to the route deadline."""
        if self.allowed is None:
            return
        now = time.time()
        bans = self.swarm.bans
        if any(bans.is_banned(p, now) and not bans.is_liar(p, now) for p in self.allowed):
            return
        try:
            plan_route(
                self.swarm.snapshot(),
                start,
                end,
                allowed_servers=self.allowed,
                blocked_servers=self.blocked,
            )
        except NoRouteError as e:
            if e.due_to_allowed_servers:
                raise

    async def _check_adapter_offered(self, adapter: str) -> None:
        """Fail at once, not after ROUTE_WAIT_S, when no server in the swarm has the adapter."""
        for attempt in range(2):
            offered = {name for r in self.swarm.snapshot().records for name in r.adapters}
            if adapter in offered:
                return
            if attempt == 0:
                await self.swarm.refresh()
        listed = ", ".join(sorted(offered)) or "none"
        raise AdapterUnavailable(
            f"no server of {self.swarm.model} offers adapter {adapter!r} (adapters in the swarm: "
            f"{listed}); start servers with `peerd start --adapters DIR` where DIR's name is "
            f"{adapter!r}"
        )


def explain_unreachable(swarm: SwarmView, missing: Iterable[tuple[int, int]]) -> str:
    """Which servers that held some of the `missing` block ranges are still around as far
    as we know but could not be reached at our last try, and why ("" if none): a server
    behind NAT whose relays went away looks gone from here although it still runs."""
    now = time.time()
    out = []
    for peer_id, reason in sorted(swarm.unreachable.items()):
        record = swarm.last_seen.get(peer_id)
        if record is None or not any(record.start < b and a < record.end for a, b in missing):
            continue
        out.append(
            f"server {peer_id} (blocks {record.start}:{record.end}, last answered "
            f"{now - record.updated_at:.0f} s ago) may still run but cannot be reached from "
            f"here: {reason}"
        )
    if not out:
        return ""
    return (
        "; ".join(out) + ". A server behind NAT is reached through relays: it needs a "
        "reservation on a relay this daemon can reach (`peerd status` on it lists its "
        "/p2p-circuit addresses), or a public address"
    )


def _appendable(
    past: torch.Tensor, hidden: torch.Tensor, buffer: torch.Tensor | None, written: int
) -> bool:
    """Whether `past` is all that `buffer` holds (its first `written` positions: no view of a
    later position exists) and `hidden` (of its batch and width) fits after it."""
    return (
        buffer is not None
        and past.data_ptr() == buffer.data_ptr()
        and past.stride() == buffer.stride()
        and past.shape[1] == written
        and written + hidden.shape[1] <= buffer.shape[1]
        and past.dtype == hidden.dtype == buffer.dtype
    )
