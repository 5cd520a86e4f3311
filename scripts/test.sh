#!/usr/bin/env bash
# Set up (scripts/setup.sh) plus what only the tests use, then lint, type-check and run every
# test, including the slow, multi-process ones. This is what CI runs (.ci/run), as root on a
# clean machine with no stdin: everything below installs without asking.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/apt.sh

# The gateway's browser test drives Debian's chromium through Playwright (never `playwright
# install`: it downloads browsers from the internet).
apt_need "the gateway's browser test (skipped without it)" chromium chromium-driver || true
# tests/test_operations.py checks the unit of `peerd service install` with systemd-analyze.
apt_need "the service unit test (skipped without it)" systemd || true
# The NAT tests (tests/test_netns.py) build home networks from network namespaces (iproute2)
# behind NAT routers (iptables MASQUERADE).
apt_need "the NAT tests (skipped without them)" iproute2 iptables || true
# pytest and its plugins, ruff, mypy, and the references some tests compare with (pyproject's dev).
.venv/bin/python -m pip --disable-pip-version-check -q install -e '.[dev]'
[ ${#APT_INSTALLED[@]} -eq 0 ] || echo "peerd tests: installed ${APT_INSTALLED[*]}"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=60)
if [ $# -gt 0 ]; then  # the tests named on the command line, after the type check
    .venv/bin/mypy
    exec "${pytest[@]}" "$@"
fi
# The type check runs beside the fast in-process tests, then the tests where processes and
# networks are what is tested. Both parts run on two pytest-xdist workers, a module (or the
# modules sharing conftest's swarm) whole on one worker: a test gives torch one thread (conftest),
# and a multi-process test kept 0.6-0.7 of the 2 cores busy on average (a chain of daemons
# computes one hop at a time; some tests mostly wait for a timeout), so two at once fill them.
# Tests marked quality (minutes of compute behind an issue's figures: perplexity per dtype, 30
# steps of prompt tuning, the attack catalogue against live daemons) run when asked:
# `bash scripts/test.sh -m quality`.
workers=(-n 2 --dist loadfile)
mypy_log=$(mktemp)
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
fast=0
"${pytest[@]}" "${workers[@]}" -m "not slow and not multiprocess and not netns" || fast=$?
typed=0
wait "$mypy_pid" || typed=$?
cat "$mypy_log"
slow=0
"${pytest[@]}" "${workers[@]}" -m "(slow or multiprocess or netns) and not quality" || slow=$?
echo "peerd tests: fast exit $fast, mypy exit $typed, slow exit $slow"
[ "$fast" -eq 0 ] && [ "$typed" -eq 0 ] && [ "$slow" -eq 0 ]
