"""`peerd bench soak`, short: generations keep coming out right while a server is killed and
restarted under them (the full five-minute run is the benchmark's, not CI's)."""

from __future__ import annotations

import pytest

from peerd.bench.soak import run_soak_bench

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_short_soak_loses_no_generation() -> None:
    report = run_soak_bench(
        duration_s=15, clients=2, kill_every_s=5, new_tokens=8, warmup_s=3, spans=("0:30",)
    )
    print(report)
    assert report["kills"] >= 1, report
    assert report["failed"] == 0, report["errors"]
    assert report["mismatched"] == 0, report
    assert report["completed"] >= 2
    assert report["token_latency_p50_s"] <= report["token_latency_p95_s"]
    assert set(report["rss_end_mb"]) == {"client", "s0"}
