"""`peerd bench idle`, short: the report of three idle daemons holds real CPU shares and resident
memory for each (the one-minute run and its 1% target are the benchmark's, not CI's)."""

from __future__ import annotations

import math

import pytest

from peerd.bench.idle import PRODUCTION_REFRESH_S, SPANS, run_idle_bench


def test_the_bench_idles_at_peerd_starts_refresh_period() -> None:
    from peerd.daemon.commands import REFRESH_PERIOD

    assert REFRESH_PERIOD.default == PRODUCTION_REFRESH_S


def test_an_empty_window_is_refused_before_any_daemon_starts() -> None:
    with pytest.raises(ValueError, match="--idle-s"):
        run_idle_bench(idle_s=0, settle_s=0, progress=False)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_short_idle_run_reports_each_daemons_cpu_share_and_memory() -> None:
    report = run_idle_bench(idle_s=10, settle_s=5, progress=False)
    print(report)
    daemons = report["daemons"]
    assert [(d["name"], d["blocks"]) for d in daemons] == list(SPANS)
    for d in daemons:
        assert isinstance(d["cpu_fraction"], float) and math.isfinite(d["cpu_fraction"]), d
        assert 0.0 <= d["cpu_fraction"] <= 2.0, d
        assert d["rss_mb"] > 50, d  # torch, py-libp2p and 10 blocks' weights are resident
    assert report["max_cpu_fraction"] == max(d["cpu_fraction"] for d in daemons)
    assert report["within_target"] == all(
        d["cpu_fraction"] <= report["target_cpu_fraction"] for d in daemons
    )
    assert report["refresh_period_s"] == PRODUCTION_REFRESH_S
    assert (report["idle_s"], report["settle_s"]) == (10, 5)


def test_the_text_report_names_each_daemon_and_the_verdict() -> None:
    from peerd.bench.idle import format_idle_report

    report = {
        "daemons": [
            {"name": "a", "blocks": "0:10", "cpu_fraction": 0.006, "rss_mb": 418.5},
            {"name": "b", "blocks": "10:20", "cpu_fraction": 0.012, "rss_mb": 420.0},
        ],
        "max_cpu_fraction": 0.012,
        "target_cpu_fraction": 0.01,
        "within_target": False,
        "refresh_period_s": 60.0,
        "idle_s": 60.0,
        "settle_s": 20.0,
    }
    assert format_idle_report(report).splitlines() == [
        "a (blocks 0:10): 0.60% of a core, 418 MB resident",
        "b (blocks 10:20): 1.20% of a core, 420 MB resident",
        "max 1.20% of a core over 60 s idle (settled 20 s, refresh period 60 s): OVER the target"
        " of 1%",
    ]
