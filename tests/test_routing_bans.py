"""BanList: exponential backoff per peer on the caller's clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.bans import BanList
from tests.test_routing_fixtures import relaxed


def test_first_failure_bans_for_the_base_time() -> None:
    bans = BanList(base_s=1.0, max_s=300.0)
    assert bans.record_failure("a", now=10.0) == 11.0
    assert bans.is_banned("a", 10.0)
    assert bans.is_banned("a", 10.999)
    assert not bans.is_banned("a", 11.0)
    assert not bans.is_banned("b", 10.0)


def test_ban_doubles_per_failure_up_to_the_cap() -> None:
    bans = BanList(base_s=1.0, max_s=5.0)
    now = 0.0
    lengths = []
    for _ in range(6):
        until = bans.record_failure("a", now)
        lengths.append(until - now)
        now = until  # fail again right when the ban ends
    assert lengths == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert bans.failures("a") == 6


def test_failures_during_a_ban_count_once() -> None:
    bans = BanList(base_s=1.0)
    assert bans.record_failure("a", 0.0) == 1.0
    assert bans.record_failure("a", 0.5) == 1.0
    assert bans.failures("a") == 1
    assert bans.record_failure("a", 1.0) == 3.0


def test_success_forgives() -> None:
    bans = BanList(base_s=1.0)
    bans.record_failure("a", 0.0)
    bans.record_failure("a", 1.0)
    bans.record_success("a")
    assert not bans.is_banned("a", 1.5)
    assert bans.failures("a") == 0
    assert bans.banned_until("a") is None
    assert bans.record_failure("a", 2.0) == 3.0
    bans.record_success("never-failed")  # harmless


def test_banned_lists_current_bans() -> None:
    bans = BanList(base_s=2.0)
    bans.record_failure("a", 0.0)
    bans.record_failure("b", 1.0)
    assert bans.banned(1.5) == {"a", "b"}
    assert bans.banned(2.5) == {"b"}
    assert bans.banned(3.0) == frozenset()
    assert bans.banned_until("b") == 3.0


def test_a_thousand_failures_do_not_overflow() -> None:
    bans = BanList(base_s=1.0, max_s=300.0)
    now = 0.0
    for _ in range(1000):
        now = bans.record_failure("a", now)
    assert bans.banned_until("a") == pytest.approx(now)
    assert bans.is_banned("a", now - 299.0)


@pytest.mark.parametrize(
    ("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0), (1.0, float("inf"))]
)
def test_rejects_bad_limits(base: float, cap: float) -> None:
    with pytest.raises(ValueError):
        BanList(base_s=base, max_s=cap)


@relaxed
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.floats(0, 50)), max_size=40))
def test_bans_never_exceed_the_cap(events: list[tuple[str, bool, float]]) -> None:
    bans = BanList(base_s=0.5, max_s=8.0)
    now = 0.0
    for peer, failed, dt in events:
        now += dt
        if failed:
            until = bans.record_failure(peer, now)
            assert now < until <= now + 8.0
            assert bans.is_banned(peer, now)
        else:
            bans.record_success(peer)
            assert not bans.is_banned(peer, now)


def test_a_liar_stays_banned_whatever_it_answers_later() -> None:
    bans = BanList(base_s=1.0, max_s=5.0)
    assert bans.ban_liar("liar", now=10.0, seconds=1000.0) == 1010.0
    bans.record_success("liar")
    assert bans.is_banned("liar", 500.0) and bans.is_liar("liar", 500.0)
    assert bans.banned(500.0) == frozenset({"liar"})
    bans.record_failure("liar", now=600.0)  # a short ban on top does not shorten it
    assert bans.is_banned("liar", 1009.0)
    assert not bans.is_banned("liar", 1010.0)
