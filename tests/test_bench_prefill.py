"""`peerd bench prefill`, short: a long prompt through two real daemons pinned apart, whole and
pipelined in chunks over py-libp2p's push streams, gives the same tokens (the servers' caches
hold the whole prompt either way); the speedup is the benchmark's figure, not CI's."""

from __future__ import annotations

import math
import os

import pytest

from peerd.bench.prefill import run_prefill_bench


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins two daemons to two cores")
def test_a_pipelined_prompt_through_real_daemons_gives_the_tokens_of_the_whole_one() -> None:
    report = run_prefill_bench(runs=1, repeat=2, colocated=False, new_tokens=6)
    print(report)
    assert report["prompt_tokens"] == 168 and report["chunks"] == 2
    assert report["same_tokens"]
    for key in ("ttft_whole_s", "ttft_pipelined_s", "speedup"):
        assert math.isfinite(report[key]) and report[key] > 0, key


def test_one_core_is_refused_before_any_daemon_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from peerd.bench import prefill

    monkeypatch.setattr(prefill.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(prefill, "LocalSwarm", None)  # starting one would fail loudly
    with pytest.raises(ValueError, match="two cores"):
        prefill.run_prefill_bench(runs=1)
