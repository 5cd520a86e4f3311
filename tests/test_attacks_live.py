"""The security review's attack catalogue (peerd.bench.attack) against one real swarm of three
daemons while an honest client generates: after every attack all daemons still run and every
honest generation came out right. Timing and memory are the benchmark's to report
(`peerd bench attack --json`), not asserted here: a loaded CI machine would make them flake."""

from __future__ import annotations

import json

import pytest

from peerd.bench.attack import run_attack_bench
from peerd.bench.attack_catalogue import CATALOGUE, NOT_ROUTED

# Not in CI (130-225 s there): each attack's handling is tested in process (test_hostile_inputs,
# test_hostile_replies, test_fuzz_*, test_training_limits); this is the whole catalogue against
# live daemons, as `peerd bench attack` runs it. `bash scripts/test.sh -m quality` runs it.
pytestmark = [pytest.mark.multiprocess, pytest.mark.quality]


@pytest.mark.timeout(1500)  # 12 min on a 2-core machine shared by 8 busy engineers (load ~20)
def test_every_attack_leaves_the_daemons_alive_and_the_honest_client_served() -> None:
    # Floods of one second and generations of two tokens: as short as the catalogue gets.
    report = run_attack_bench(attack_s=1.0, new_tokens=2, baseline_runs=1)
    print(json.dumps(report, indent=1))
    assert [a["name"] for a in report["attacks"]] == [spec.name for spec in CATALOGUE]
    broken = {
        a["name"]: {k: a.get(k) for k in ("dead", "honest_errors", "detail", "dead_log_tail")}
        for a in report["attacks"]
        if not (a["daemon_alive"] and a["honest_ok"])
        # An attack must have been made; only whether the honest client routes through a
        # fake server in time is not ours to decide (it is reported, not asserted).
        or a["detail"].get("attack_error", NOT_ROUTED) != NOT_ROUTED
    }
    assert not broken, json.dumps(broken, indent=1)
