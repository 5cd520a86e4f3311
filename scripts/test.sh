#!/usr/bin/env bash
# Set up (scripts/setup.sh), then lint, type-check and run every test, including the slow,
# multi-process ones. This is what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
