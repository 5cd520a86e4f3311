"""peerd.session.coalesce.Coalescer: concurrent calls run as one batch, and members (concurrent
generations, a call per token) wait briefly for each other, so their next steps leave together;
never for a member that is not due (slower, or stalled), and never longer than their bound."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import trio
import trio.testing

from peerd.session.coalesce import GATHER_FIRST_S, Coalescer


def _recorder(micro_batches: int = 1) -> tuple[Coalescer[int, int], list[list[int]]]:
    """A coalescer whose batches run on the event loop (no worker thread: the tests run on
    trio's autojump clock, whose time must not jump while a thread works), and its batches."""
    batches: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        batches.append(sorted(items))
        return [i * 10 for i in items]

    async def inline(fn: Callable[[list[int]], list[int]], items: list[int]) -> list[int]:
        await trio.sleep(0.001)  # a batch takes time; calls meanwhile queue for the next
        return fn(items)

    return Coalescer(run, inline, micro_batches=micro_batches, split_members=4), batches


async def test_calls_while_a_batch_runs_go_together_in_the_next() -> None:
    coalescer, batches = _recorder()
    results: dict[int, int] = {}

    async def call(i: int) -> None:
        results[i] = await coalescer(i)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(call, i)
    assert results == {0: 0, 1: 10, 2: 20, 3: 30}
    assert sum(len(b) for b in batches) == 4 and len(batches) <= 2


async def test_members_in_step_wait_for_each_other_and_run_in_one_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    coalescer, batches = _recorder()
    period = 0.2  # each member calls, then takes this long (its step) to call again

    async def member(i: int, lag: float) -> None:
        with coalescer.member(i):
            for _ in range(4):
                await trio.sleep(period + lag)
                await coalescer(i, i)
                lag = 0.0  # the first calls straggle (prefills of other lengths); then in step

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(member, i, 0.005 * i)
    # Without members the first call of each round would run alone: 8 batches at least.
    assert batches == [[0, 1, 2, 3]] * 4


async def test_a_member_not_due_is_not_waited_for(autojump_clock: trio.testing.MockClock) -> None:
    coalescer, _ = _recorder()
    clock_started = trio.current_time()
    ran_at: list[float] = []

    async def fast() -> None:
        with coalescer.member("fast"):
            for _ in range(6):
                await trio.sleep(0.05)
                await coalescer(1, "fast")
                ran_at.append(trio.current_time() - clock_started)

    async def slow() -> None:  # a slower route: calls every 2 s
        with coalescer.member("slow"):
            await coalescer(2, "slow")
            await trio.sleep(2.0)
            await coalescer(2, "slow")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow)
        await trio.sleep(0.001)
        nursery.start_soon(fast)
    # The fast member waited at most GATHER_FIRST_S once (the slow one had called only once),
    # never a quarter of its period for the slow one after that.
    gaps = [b - a for a, b in itertools.pairwise(ran_at)]
    assert all(gap <= 0.05 + 0.001 + 1e-9 for gap in gaps[1:]), gaps
    assert gaps[0] <= 0.05 + 0.001 + GATHER_FIRST_S + 1e-9, gaps


async def test_a_stalled_member_holds_nobody_up_for_long(
    autojump_clock: trio.testing.MockClock,
) -> None:
    coalescer, batches = _recorder()

    async def stalled() -> None:  # called once, then its reader went away
        with coalescer.member("stalled"):
            await coalescer(0, "stalled")
            await trio.sleep_forever()

    waits: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalled)
        await trio.testing.wait_all_tasks_blocked()
        with coalescer.member("live"):
            for _ in range(10):
                await trio.sleep(0.05)
                started = trio.current_time()
                await coalescer(1, "live")
                waits.append(trio.current_time() - started - 0.001)  # less the batch itself
        nursery.cancel_scope.cancel()
    assert batches[0] == [0] and all(b == [1] for b in batches[1:])
    # Late by more than a period, it is not waited for at all; before, a quarter period at most.
    assert max(waits) <= 0.25 * 0.051 + 1e-9 and max(waits[3:]) <= 1e-9, waits


async def test_a_lone_callers_short_batches_run_on_the_loop_once_timed() -> None:
    import threading

    loop = threading.current_thread()
    ran_on_loop: list[bool] = []

    def run(items: list[int]) -> list[int]:
        ran_on_loop.append(threading.current_thread() is loop)
        return items

    coalescer: Coalescer[int, int] = Coalescer(run, inline_max_s=10.0)
    with coalescer.member("a"):
        for i in range(3):
            assert await coalescer(i, "a") == i
    # The first batch runs in a worker thread (its time unknown); then on the loop.
    assert ran_on_loop == [False, True, True]
    # Two members: batches go to the worker thread again, whoever calls.
    with coalescer.member("a"), coalescer.member("b"):
        await coalescer(3, "a")
    assert ran_on_loop[-1] is False
    # Without inline_max_s (the default), never on the loop.
    plain: Coalescer[int, int] = Coalescer(run)
    for i in range(3):
        await plain(i)
    assert ran_on_loop[-3:] == [False, False, False]


async def test_enough_members_split_into_micro_batches_that_run_apart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    coalescer, batches = _recorder(micro_batches=2)
    groups: dict[int, list[int | None]] = {}

    async def member(i: int) -> None:
        with coalescer.member(i):
            for _ in range(4):
                await trio.sleep(0.2)
                groups.setdefault(i, []).append(coalescer.group_of(i))
                await coalescer(i, i)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(member, i)
    # Joined in turn, they alternate between the groups (four each); each keeps its group, and a
    # batch holds one whole group's calls (the two groups' batches run one after the other).
    # The last round may re-form: the first group to finish leaves the other to split in two.
    assert all(len(set(g[:3])) == 1 for g in groups.values()), groups
    members = {g: [i for i in range(8) if groups[i][0] == g] for g in (0, 1)}
    assert sorted(map(len, members.values())) == [4, 4]
    assert sorted(batches[:6]) == sorted([members[0]] * 3 + [members[1]] * 3), batches
    assert sorted(i for batch in batches for i in batch) == sorted(list(range(8)) * 4)


async def test_few_members_run_together_and_newcomers_join_the_smaller_group() -> None:
    coalescer, _ = _recorder(micro_batches=2)
    with coalescer.member("a"), coalescer.member("b"), coalescer.member("c"):
        assert [coalescer.group_of(k) for k in "abc"] == [None] * 3  # fewer than split_members
        with coalescer.member("d"):
            assert [coalescer.group_of(k) for k in "abcd"] == [0, 1, 0, 1]
            assert coalescer.group_of("not a member") is None
            with coalescer.member("unsplit", split=False):  # not counted, runs with non-members
                assert [coalescer.group_of(k) for k in ("a", "d", "unsplit")] == [0, 1, None]
        with coalescer.member("x", split=False):
            assert [coalescer.group_of(k) for k in "abcx"] == [None] * 4  # 3 that may split
        with coalescer.member("e"):  # d left: group 1 is the smaller one
            assert [coalescer.group_of(k) for k in "abce"] == [0, 1, 0, 1]


async def test_groups_left_uneven_by_members_leaving_are_evened_out() -> None:
    coalescer, _ = _recorder(micro_batches=2)
    with contextlib.ExitStack() as everyone:
        stacks = {k: everyone.enter_context(contextlib.ExitStack()) for k in range(8)}
        for k, stack in stacks.items():
            stack.enter_context(coalescer.member(k))
        assert [coalescer.group_of(k) for k in range(8)] == [0, 1] * 4
        for k in (5, 3, 1):  # once group 1 is two behind, group 0's latest to join (6) moves
            stacks[k].close()
        assert {k: coalescer.group_of(k) for k in (0, 2, 4, 6, 7)} == {
            0: 0,
            2: 0,
            4: 0,
            6: 1,
            7: 1,
        }


def test_micro_batches_must_fit_the_split() -> None:
    for micro_batches, split in ((0, 4), (5, 4)):
        try:
            Coalescer(lambda items: items, micro_batches=micro_batches, split_members=split)
        except ValueError as e:
            assert "micro_batches" in str(e)
        else:
            raise AssertionError(f"{micro_batches}, {split} accepted")
