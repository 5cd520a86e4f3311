"""Admission control of a block server (peerd.admission): the FIFO wait for cache, its typed
timeout, and the per-peer limits on sessions and bytes in flight. Pure trio, no network."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from blocks import MemoryCache, SpanSession
from peerd.admission import Admission, Refused


def _admission(**limits: int) -> Admission:
    return Admission(
        max_sessions_per_peer=limits.get("sessions", 4),
        max_inflight_bytes_per_peer=limits.get("inflight", 100),
    )


async def test_waiting_sessions_get_cache_in_arrival_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=100)
    admission = _admission()
    held = cache.open_session(1, 60)
    order: list[str] = []
    opened: list[SpanSession] = []

    async def ask(name: str, tokens: int) -> None:
        opened.append(await admission.open_session(cache, 1, tokens, wait_s=30))
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "big", 60)
        await trio.sleep(1)
        # 40 tokens are free, enough for "small", but "big" came first and waits at the head.
        nursery.start_soon(ask, "small", 30)
        await trio.sleep(1)
        assert order == [] and admission.queued == 2 and admission.queued_tokens == 90
        held.close()
        admission.cache_freed()
    assert order == ["big", "small"]
    assert admission.queued == 0 and cache.free_tokens == 10
    for session in opened:
        session.close()


async def test_a_wait_that_times_out_is_a_typed_explained_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=100)
    admission = _admission()
    held = cache.open_session(1, 70)
    started = trio.current_time()
    with pytest.raises(Refused) as refused:
        await admission.open_session(cache, 2, 25, wait_s=5)
    assert refused.value.code == "cache_full_timeout"
    assert trio.current_time() - started == pytest.approx(5)
    message = str(refused.value)
    assert "30 of 100 tokens free" in message and "asks for 50" in message
    assert "another server" in message
    assert admission.timeouts == 1 and admission.queued == 0
    # The cache is untouched and the next request that fits gets in at once.
    held.close()
    (await admission.open_session(cache, 2, 25, wait_s=0)).close()


async def test_the_wait_is_capped_and_oversized_sessions_are_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache = MemoryCache(budget_tokens=100)
    admission = Admission(max_sessions_per_peer=4, max_inflight_bytes_per_peer=1, max_wait_s=2)
    with pytest.raises(Refused) as refused:
        await admission.open_session(cache, 1, 101, wait_s=30)
    assert refused.value.code == "out_of_cache" and "whole cache of 100" in str(refused.value)
    held = cache.open_session(1, 100)
    started = trio.current_time()
    with pytest.raises(Refused, match=r"after waiting 2\.0 s"):
        await admission.open_session(cache, 1, 1, wait_s=3600)
    assert trio.current_time() - started == pytest.approx(2)
    held.close()


async def test_a_full_queue_says_busy(autojump_clock: trio.testing.MockClock) -> None:
    cache = MemoryCache(budget_tokens=10)
    admission = Admission(max_sessions_per_peer=9, max_inflight_bytes_per_peer=1, max_queued=2)
    held = cache.open_session(1, 10)
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(admission.open_session, cache, 1, 5, 10.0)
        await trio.sleep(1)
        with pytest.raises(Refused) as refused:
            await admission.open_session(cache, 1, 5, wait_s=10)
        assert refused.value.code == "busy"
        held.close()
        admission.cache_freed()
    assert cache.free_tokens == 0


def test_sessions_per_peer_are_limited_and_other_peers_go_on() -> None:
    admission = _admission(sessions=2)
    with admission.session_slot("a"), admission.session_slot("a"):
        with pytest.raises(Refused) as refused, admission.session_slot("a"):
            pass
        assert refused.value.code == "too_many_sessions" and "peer a" in str(refused.value)
        with admission.session_slot("b"):
            assert admission.sessions_of("b") == 1
    assert admission.sessions_of("a") == 0
    with admission.session_slot("a"):
        pass


def test_bytes_in_flight_per_peer_are_limited() -> None:
    admission = _admission(inflight=100)
    # One step alone always runs, even past the limit (else a big prefill could never run).
    with admission.inflight("a", 150):
        assert admission.inflight_bytes_of("a") == 150
        with pytest.raises(Refused) as refused, admission.inflight("a", 10):
            pass
        assert refused.value.code == "inflight_limit" and "150 bytes" in str(refused.value)
        with admission.inflight("b", 60), admission.inflight("b", 40):
            assert admission.inflight_bytes_of("b") == 100
    assert admission.inflight_bytes_of("a") == admission.inflight_bytes_of("b") == 0
