"""Server-side batching: concurrent steps of different sessions on one span run as one forward
on the compute queue, and every session waits its fair turn.

A decode step of one sequence reads every weight of the span to compute one token, and on a CPU
most of its time is per-operation overhead, so a forward of 8 rows costs little more than a
forward of one. Steps that arrive while the device is busy wait here; when the device is free,
one round takes them together: the short ones (decode steps, small prefills) of one span merged
into a single forward, or one piece of a long prefill on its own. Turns go to the client served
least recently (then to the oldest step), so a client with a long prompt or many sessions cannot
starve the others: a long prefill runs a chunk per turn, and decode rounds run between its chunks.
With a `Priority` (peerd.server.priority), that fair order is then rearranged by standing:
contributors' steps first, takers keeping their guaranteed share of the tokens run, and while
other peers use the server a long step's turns are cut to PRIORITY_TURN_TOKENS so a
contributor's step never waits long for one (with no other peer about, a prefill keeps its whole
chunks: short turns cost a lone prompt about a third more time to its first token). While a
contributor is active here, turns of takers' work alone are held back (priority.Reservation): each
rests in proportion to its run time before the next may start, and their long steps run
RESERVED_TURN_TOKENS per turn, so a contributor's step finds the device free most of the time and
waits little when it does not; its round then takes only contributors' steps, and it waits for
its partners only RESERVED_GATHER_S, and only for contributors' sessions. On a CPU device those
takers' turns run in a lane of their own at the lowest CPU priority (peerd.server.lane), off the
compute queue: a contributor's step that comes meanwhile runs at once, beside the takers' turn,
and takes the cores first; the rest after such a turn is reckoned from its CPU time, since the
kernel keeps it waiting whenever nice-0 threads want the cores.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import torch
import trio

from blocks import Span, SpanSession
from blocks import threads as torch_threads
from peerd.server.compute import PRIORITY_INFERENCE, ComputeQueue
from peerd.server.lane import LowPriorityLane, lanes_supported
from peerd.server.priority import CONTRIBUTOR, TAKER, Priority, Reservation
from peerd.server.steps import BatchCounters, Recent, Step, StepTimes

# Most rows one merged forward takes; the rest wait for the next round (keeps a round short).
MAX_BATCH_ROWS = 32
# Steps of up to this many tokens merge with others of about their length (decode steps with
# decode steps, small prefills, short replays); longer ones run alone, a chunk a turn.
MERGE_MAX_TOKENS = 16
# Steps that ran together in one forward come back together: the previous server pushes its
# merged outputs one after another, a client sends the steps of one LM-head pass one after
# another. When the device is free and a step's partners of its last forward (its cohort) are not
# all here yet, it waits for them, so the group runs as one forward again instead of splitting
# into forwards of one. The wait is a fraction of the time between the session's steps (a step
# that comes every 400 ms may wait 100 ms for partners that save a whole forward), within these
# bounds. Steps of other groups are not waited for: they join when they happen to queue
# together, and stay together from then on. A lone session never waits.
GATHER_FRACTION = 0.25
GATHER_MIN_S = 0.005
GATHER_MAX_S = 0.1
# While contributors have the device reserved (priority.Reservation), a contributor's step waits
# at most this long for its partners: enough for the outputs of one merged forward, pushed one
# after another, not for a partner that a takers' turn delays on another hop (waiting for it
# would cost the step that turn's time on every later hop too).
RESERVED_GATHER_S = 0.01
ACTIVE_S = 1.0  # a session that stepped longer ago has left its cohort (finished or stalls)
# With priority by standing, a long step runs at most this many tokens per turn: a contributor's
# step cannot preempt the turn under way, so it waits for that turn on every hop, and a whole
# prefill chunk (Span.chunk_tokens) takes several decode steps' time.
PRIORITY_TURN_TOKENS = 64
# While a contributor is active (priority.Reservation), shorter still: a turn of 16 tokens through
# 10 blocks of the default model takes ~30 ms on one CPU core (32 tokens ~47 ms, 64 ~76 ms; a
# decode step ~16 ms), so a contributor's step that finds one under way waits ~15 ms for it on
# average, for less takers' throughput per turn of the device (takers rest meanwhile anyway).
RESERVED_TURN_TOKENS = 16
# A lone short step (at most INLINE_MAX_TOKENS rows x tokens, no other session active) on one torch
# thread (peerd.node.compute_thread) may run on the event loop (ComputeQueue.run's `inline`): the
# hand-off to the compute thread and back cost ~0.6 ms a hop on the 2-core development machine.
INLINE_MAX_TOKENS = 16


class StepBatcher:
    """Runs inference steps on `compute`, merging concurrent ones (`enabled=False`: one step per
    forward, in the same fair order, as a baseline)."""

    def __init__(
        self,
        compute: ComputeQueue,
        *,
        enabled: bool = True,
        max_rows: int = MAX_BATCH_ROWS,
        priority: Priority | None = None,
        timer: Callable[[], float] = time.perf_counter,
        cpu_timer: Callable[[], float] = time.thread_time,
    ) -> None:
        self.compute = compute
        self.enabled = enabled
        self.priority = priority  # who goes first by standing (None: the fair order alone)
        # takers' turns held back while a contributor is active (a no-op with fifo)
        self.reservation = Reservation(priority) if priority is not None else None
        self._timer = timer  # times a turn's forward (in the worker thread)
        self._cpu_timer = cpu_timer  # the CPU time of a turn in the lane (its thread's)
        # Contributors have the device reserved (set on the event loop, when a round is queued
        # or a contributor's step comes); a round reads it once as it starts (_round_reserved).
        self._reserving = False
        self._round_reserved = False
        self._taker_turn_s: float | None = None  # the last round ran takers' work alone this long
        self.max_rows = max_rows
        self.counters = BatchCounters()
        self.times = {CONTRIBUTOR: StepTimes(), TAKER: StepTimes()}  # by class
        self._waiting: list[Step] = []
        self._lock = threading.Lock()  # _waiting is read by rounds in the worker thread
        self._order = itertools.count()
        self._rounds = itertools.count(1)
        self._last_turn: dict[str, int] = {}  # owner -> round that last served it
        self._round_queued = False
        self._round_over = trio.Event()
        self._changed = trio.Event()  # set when a step comes or a round is queued (_gather)
        self._recent: dict[int, Recent] = {}  # id(session) -> what we know of its steps
        # Takers' turns while contributors have a CPU device reserved (lane.py): busy (_lock) from
        # the hand-over until the event loop took the turn's end and rest (_lane_turn_over).
        self.lane = LowPriorityLane() if lanes_supported() and priority is not None else None
        self._lane_busy = False
        self._lane_over = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None

    async def run(
        self,
        span: Span,
        session: SpanSession,
        hidden: torch.Tensor,
        owner: str,
        adapter: str | None = None,
        priority: int = PRIORITY_INFERENCE,
        micro_batch: int | None = None,
    ) -> torch.Tensor:
        """span(hidden, session, adapter), run in some round on the compute queue; the same
        result (up to float rounding) and the same errors as running it alone."""
        order, position = next(self._order), session.position
        step = Step(span, session, hidden, owner, order, position, adapter, micro_batch)
        arrived = self._timer()
        self._token = trio.lowlevel.current_trio_token()
        now = trio.current_time()
        recent = self._stepped(session, owner, now)
        step.shared = any(
            other.owner != owner and now - other.at <= ACTIVE_S and not other.session.closed
            for other in self._recent.values()
        )
        if self.reservation is not None:
            self.reservation.stepped(owner, now)
            self._reserving = self.reservation.active(now)
        with self._lock:
            self._waiting.append(step)
        self._notify()
        try:
            while not step.finished:
                if step.in_lane:  # as a round on the compute queue, not to be cancelled midway
                    with trio.CancelScope(shield=True):
                        await self._lane_over.wait()
                    continue
                if not self._round_queued and self.enabled:
                    await self._gather(span, recent)
                if self._round_queued:  # a round is queued or running: it may take this step
                    await self._round_over.wait()
                    continue
                if await self._held_back():
                    continue
                self._round_queued = True
                self._notify()
                try:
                    await self.compute.run(priority, self._round, inline=self._inline(step))
                finally:
                    self._round_queued = False
                    self._after_round()
                    over, self._round_over = self._round_over, trio.Event()
                    over.set()
        finally:
            with self._lock:
                step.abandoned = not step.finished
                if step in self._waiting:  # cancelled before (or between) its turns
                    self._waiting.remove(step)
                    step.undo()
        if step.error is not None:
            raise step.error
        self._time(step, arrived)
        return step.outputs[0] if len(step.outputs) == 1 else torch.cat(step.outputs, dim=1)

    def _inline(self, step: Step) -> bool:
        """Whether the round `step` queues may run on the event loop (INLINE_MAX_TOKENS)."""
        now = trio.current_time()
        with self._lock:
            alone = self._waiting == [step]
        return (
            alone
            and step.rows * step.left <= INLINE_MAX_TOKENS
            and torch_threads.POLICY.threads_for(step.rows * step.left) == 1
            and not (self._reserving or self._lane_busy)
            and all(
                other.session is step.session or now - other.at > ACTIVE_S or other.session.closed
                for other in self._recent.values()
            )
        )

    def _stepped(self, session: SpanSession, owner: str, now: float) -> Recent:
        """Note that `owner` sent a step of `session` at `now`: what we know of the session."""
        recent = self._recent.get(id(session))
        if recent is None or recent.session is not session:
            recent = self._recent[id(session)] = Recent(session, owner, now)
        else:
            interval = now - recent.at
            recent.period = interval if not recent.period else 0.7 * recent.period + 0.3 * interval
            recent.at = now
        return recent

    def _time(self, step: Step, arrived: float) -> None:
        """Count a finished step's time here under its owner's class."""
        contributor = self.priority is not None and self.priority.is_contributor(step.owner)
        times = self.times[CONTRIBUTOR if contributor else TAKER]
        times.add(self._timer() - arrived, step.forward_s)

    async def _held_back(self) -> bool:
        """Wait out the takers' rest when the next round would run takers' work alone (no
        contributor's step waits): True if it waited (the queue may have changed since)."""
        if self.reservation is None:
            return False
        now = trio.current_time()
        self._reserving = self.reservation.active(now)
        wait = self.reservation.taker_wait(now)
        # the next takers' turn goes to the lane too, after the one there now
        for_lane = self._reserving and self._lane_busy
        if wait <= 0 and not for_lane:
            return False
        assert self.priority is not None
        with self._lock:
            if any(self.priority.is_contributor(step.owner) for step in self._waiting):
                return False
            for_lane = self._reserving and self._lane_busy
        if for_lane:
            await self._lane_over.wait()
        elif wait > 0:
            await trio.sleep(wait)
        else:
            return False
        return True

    def _after_round(self) -> None:
        """Back on the event loop: a round of takers' work alone starts the takers' rest."""
        ran_s, self._taker_turn_s = self._taker_turn_s, None
        if ran_s is not None and self.reservation is not None:
            self.reservation.taker_turn_ran(ran_s, trio.current_time())

    def _lane_turn_over(self, cpu_s: float) -> None:
        """On the event loop, after a takers' turn in the lane that used `cpu_s` of CPU time:
        its rest starts, and its steps (and the takers' turns waiting for the lane) go on."""
        if self.reservation is not None:
            self.reservation.taker_turn_ran(cpu_s, trio.current_time())
        with self._lock:
            self._lane_busy = False
        over, self._lane_over = self._lane_over, trio.Event()
        over.set()
        self._notify()

    async def _gather(self, span: Span, recent: Recent) -> None:
        """Wait until every recently active session that ran in the same forward as a step
        waiting for `span` is here too, or a round is queued, or the step of `recent` waited
        its share of its period."""
        now = trio.current_time()
        wait = min(max(GATHER_FRACTION * recent.period, GATHER_MIN_S), GATHER_MAX_S)
        if self._reserved_for(recent.owner, now):
            wait = min(wait, RESERVED_GATHER_S)
        deadline = now + wait
        while not self._round_queued and now < deadline:
            for key, other in list(self._recent.items()):
                if now - other.at > ACTIVE_S or other.session.closed:
                    del self._recent[key]
            if not self._partners_missing(span, now):
                return
            # Until a step comes or a round is queued; a partner whose session closed or went
            # quiet has no step to come, so look again every GATHER_MIN_S (not every 1 ms: on a
            # loaded CPU server the event loop's polling took cycles from the forwards).
            with trio.move_on_at(min(deadline, now + GATHER_MIN_S)):
                await self._changed.wait()
            now = trio.current_time()

    def _notify(self) -> None:
        """Wake the steps gathering their partners: a step came, or a round was queued."""
        self._changed.set()
        self._changed = trio.Event()

    def _reserved_for(self, owner: str, now: float) -> bool:
        """The device is reserved for contributors now, and `owner` is one."""
        return (
            self.reservation is not None
            and self.reservation.active(now)
            and self.reservation.priority.is_contributor(owner)
        )

    def _partners_missing(self, span: Span, now: float) -> bool:
        """A session that ran in the same forward as a step waiting for `span` has not sent
        its next step yet. While contributors are reserved the device (their rounds take only
        their own steps), a contributor's step waits only for contributors' sessions: takers'
        are held back, and would keep it waiting GATHER_MAX_S on every hop."""
        with self._lock:
            waiting = [step for step in self._waiting if step.span is span]
        recent = self._recent
        if self.reservation is not None and self.reservation.active(now):
            assert self.priority is not None
            contributor = self.priority.is_contributor
            if any(contributor(step.owner) for step in waiting):
                waiting = [step for step in waiting if contributor(step.owner)]
                recent = {k: r for k, r in recent.items() if contributor(r.owner)}
        here = {id(step.session) for step in waiting}
        cohorts = {recent[key].cohort for key in here if key in recent} - {0}
        return any(other.cohort in cohorts and key not in here for key, other in recent.items())

    def _round(self) -> None:
        """One turn of the device (in the worker thread): pick the steps, run them, record."""
        self._round_reserved = self._reserving
        with self._lock:
            batch = self._pick()
            if not batch or self._to_lane(batch):
                return
        ran_s = self._turn(batch)
        if self._takers_only(batch):
            self._taker_turn_s = ran_s

    def _takers_only(self, batch: list[Step]) -> bool:
        """No step of `batch` is a contributor's (by standing; False without a priority)."""
        return self.priority is not None and not any(
            self.priority.is_contributor(step.owner) for step in batch
        )

    def _turn(self, batch: list[Step]) -> float:
        """Run the steps of a round (in a worker thread); return how long it took."""
        head = batch[0]
        began = self._timer()
        if len(batch) == 1 and head.left > MERGE_MAX_TOKENS:
            self._run_chunk(head)
        else:
            self._run_merged(batch)
        ran_s = self._timer() - began
        for step in batch:
            step.forward_s += ran_s
        with self._lock:
            for step in batch:
                step.in_lane = False
                if step.abandoned:
                    step.undo()
                elif not step.finished:
                    self._waiting.append(step)  # the rest of a long step: back in the queue
        self.counters.steps += sum(step.finished for step in batch)
        return ran_s

    def _to_lane(self, batch: list[Step]) -> bool:
        """Hand a round of takers' work to the lane, while contributors have a CPU device
        reserved and the lane is free (under _lock, in the worker thread): the compute queue is
        free again at once, for a contributor's step."""
        if (
            self.lane is None
            or self._lane_busy
            or not self._round_reserved
            or self._token is None
            or batch[0].span.device.type != "cpu"
            or not self._takers_only(batch)
        ):
            return False
        token = self._token
        for step in batch:
            step.in_lane = True
        self._lane_busy = True

        def job() -> None:
            # The rest that follows is the turn's CPU time times TAKER_REST, not its wall time:
            # a turn the kernel kept waiting for the nice-0 threads' sake used the cores less
            # than its wall time says, and a rest after a wait that long starved the takers
            # below their share on a busy machine (a fifth of the device, in CPU time).
            cpu_s = 0.0
            began = self._cpu_timer()
            try:
                self._turn(batch)
                cpu_s = self._cpu_timer() - began
            except BaseException as e:  # our bug: fail its steps rather than leave them waiting
                with self._lock:
                    for step in batch:
                        step.in_lane = False
                        if not step.finished:
                            step.finish(None, e)
                raise
            finally:
                try:
                    token.run_sync_soon(self._lane_turn_over, cpu_s)
                except trio.RunFinishedError:  # no run waits for it: free the lane
                    self._lane_busy = False  # (nothing else runs: no lock needed)

        assert self.lane is not None
        self.lane.submit(job)
        return True

    def _pick(self) -> list[Step]:
        """The steps of this round, taken out of the queue: the fairest first step, then (when
        it is short) every short step of the same span that fits, in the same fair order."""
        if not self._waiting:
            return []
        turn = next(self._rounds)
        queue = sorted(self._waiting, key=lambda s: (self._last_turn.get(s.owner, 0), s.order))
        if self.priority is not None:
            queue = self.priority.order(queue, lambda s: s.owner)
        head = queue[0]
        batch = [head]
        if self.enabled and head.left <= MERGE_MAX_TOKENS:
            rows, sessions = head.rows, {id(head.session)}
            tokens, longest = head.rows * head.left, head.left
            for step in self._partners(head, queue):
                # Shorter steps are padded to the longest: merge only while that pays (at most
                # half of the rows' positions padding), e.g. decode steps with decode steps.
                padded = (rows + step.rows) * max(longest, step.left)
                if (
                    step.joins(head)
                    and step.left <= MERGE_MAX_TOKENS
                    and rows + step.rows <= self.max_rows
                    and id(step.session) not in sessions
                    and padded <= 2 * (tokens + step.rows * step.left)
                ):
                    batch.append(step)
                    rows += step.rows
                    tokens += step.rows * step.left
                    longest = max(longest, step.left)
                    sessions.add(id(step.session))
        alone = len(batch) == 1 and head.left > MERGE_MAX_TOKENS
        head.shared |= any(step.owner != head.owner for step in queue)
        # decided here: a turn in the lane runs while the next round (re)sets _round_reserved
        head.turn_tokens = self._turn_tokens(head) if alone else head.left
        for step in batch:
            self._waiting.remove(step)
            self._last_turn[step.owner] = turn
            if self.priority is not None:
                tokens = min(step.left, head.turn_tokens) if alone else step.left
                self.priority.account(step.owner, step.rows * tokens)
            recent = self._recent.get(id(step.session))
            if recent is not None:  # alone (0): no partners to wait for next time
                recent.cohort = turn if len(batch) > 1 else 0
        return batch

    def _partners(self, head: Step, queue: list[Step]) -> list[Step]:
        """The steps that may merge into the round `head` leads: any, but while contributors are
        reserved the device, only contributors' steps join a contributor's: through 10 blocks of
        the default model on one CPU core a merged decode forward of 2 rows takes ~27 ms and of
        10 rows ~39 ms, so eight takers' rows would add half to the contributor's every hop."""
        rest = queue[1:]
        if self._round_reserved and self.priority is not None:
            contributor = self.priority.is_contributor
            if contributor(head.owner):
                return [step for step in rest if contributor(step.owner)]
        return rest

    def _turn_tokens(self, step: Step) -> int:
        """Tokens of a long step one turn runs."""
        if self.priority is None or not self.priority.enabled:
            return step.span.chunk_tokens
        if self._round_reserved and not self.priority.is_contributor(step.owner):
            return min(step.span.chunk_tokens, RESERVED_TURN_TOKENS)
        if step.shared:
            return min(step.span.chunk_tokens, PRIORITY_TURN_TOKENS)
        return step.span.chunk_tokens

    def _run_chunk(self, step: Step) -> None:
        """The next chunk of a long step; a failure undoes the chunks it already ran."""
        piece = step.remaining[:, : step.turn_tokens]
        try:
            output = step.span.forward(piece, step.session, step.adapter)
        except Exception as e:
            step.undo()
            step.finish(None, e)
            return
        finally:
            self.counters.forwards += 1
        step.finish(output)

    def _run_merged(self, batch: list[Step]) -> None:
        if len(batch) > 1:
            try:
                outputs = batch[0].span.forward_batch(
                    [(s.remaining, s.session) for s in batch], batch[0].adapter
                )
            except Exception:
                pass  # one step's problem (a closed session, ...): run each alone for its error
            else:
                self.counters.forwards += 1
                self.counters.merged_steps += len(batch)
                for step, output in zip(batch, outputs, strict=True):
                    step.finish(output)
                return
        for step in batch:
            try:
                output = step.span.forward(step.remaining, step.session, step.adapter)
            except Exception as e:
                step.finish(None, e)
            else:
                step.finish(output)
            finally:
                self.counters.forwards += 1
