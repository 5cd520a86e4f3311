"""RttTracker: exponentially smoothed round trips, usable as plan_route's rtts mapping."""

from __future__ import annotations

import math

import pytest

from routing.rtt import RttTracker


def test_first_sample_is_taken_as_is_then_smoothed() -> None:
    rtt = RttTracker(alpha=0.25)
    assert rtt.record("a", 0.1) == 0.1
    assert rtt.record("a", 0.5) == pytest.approx(0.2)
    assert rtt["a"] == pytest.approx(0.2)
    assert rtt.record("a", 0.2) == pytest.approx(0.2)


def test_one_outlier_moves_the_estimate_by_alpha() -> None:
    rtt = RttTracker(alpha=0.2)
    for _ in range(10):
        rtt.record("a", 0.05)
    rtt.record("a", 1.05)
    assert rtt["a"] == pytest.approx(0.25)


def test_is_a_mapping_of_known_peers() -> None:
    rtt = RttTracker()
    rtt.record("a", 0.1)
    rtt.record("b", 0.2)
    assert dict(rtt) == {"a": 0.1, "b": 0.2}
    assert len(rtt) == 2
    assert "c" not in rtt
    assert rtt.get("c", 0.05) == 0.05
    rtt.forget("a")
    rtt.forget("never-seen")
    assert list(rtt) == ["b"]


def test_failures_push_the_estimate_towards_the_failure_rtt() -> None:
    rtt = RttTracker(alpha=0.5, failure_rtt_s=2.0)
    rtt.record("a", 0.0)
    assert rtt.record_failure("a") == pytest.approx(1.0)
    assert rtt.record_failure("a") == pytest.approx(1.5)
    assert rtt.record_failure("never-pinged") == 2.0


def test_a_failure_never_makes_a_peer_look_faster() -> None:
    rtt = RttTracker(alpha=0.5, failure_rtt_s=1.0)
    rtt.record("slow", 4.0)
    assert rtt.record_failure("slow") == 4.0


def test_recovery_after_failures() -> None:
    rtt = RttTracker(alpha=0.5, failure_rtt_s=2.0)
    rtt.record_failure("a")
    for _ in range(20):
        rtt.record("a", 0.04)
    assert rtt["a"] == pytest.approx(0.04, abs=1e-5)


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_rejects_bad_samples(bad: float) -> None:
    with pytest.raises(ValueError, match="an RTT must be a finite number"):
        RttTracker().record("a", bad)


@pytest.mark.parametrize("alpha", [0.0, -0.5, 1.5])
def test_rejects_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        RttTracker(alpha=alpha)
