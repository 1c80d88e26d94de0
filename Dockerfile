# syntax=docker/dockerfile:1
# One image for the operator, the router and the engines: `pdserve operator|router|prefill|decode`.
#
#   GPU (default base):  docker build -t pdserve:0.1.0 .
#   CPU:                 docker build -t pdserve:0.1.0-cpu --build-arg BASE_IMAGE=python:3.11-slim \
#                            --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
#
# Any base with python3 >= 3.11, or an Ubuntu/Debian one without Python, works (see docs/kubernetes.md).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# Extra package index for torch. Empty: PyPI, whose Linux x86_64 torch is the CUDA build. The CPU
# index makes the pinned torch==2.13.0 resolve to 2.13.0+cpu (no CUDA libraries, ~2 GB smaller).
ARG TORCH_INDEX=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH \
    HOME=/home/pdserve \
    OMP_WAIT_POLICY=PASSIVE

# g++ and ninja: the CPU kernels (pdserve/kernels/cpu_kernels.py) and Triton's GPU launcher stubs
# are compiled at run time (without them the CPU path falls back to slower torch ops). Python,
# with its headers, where the base has none (the CUDA images). Then the non-root user, uid/gid
# 1000 (Ubuntu 24.04 images already hold an "ubuntu" user with that uid: it goes).
# hadolint ignore=DL3008,SC2086
RUN packages="g++ ninja-build" \
    && if ! command -v python3 >/dev/null; then packages="$packages python3 python3-venv python3-dev"; fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && { userdel --remove ubuntu 2>/dev/null || true; } \
    && { groupdel ubuntu 2>/dev/null || true; } \
    && groupadd --gid 1000 pdserve \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/pdserve --shell /bin/sh pdserve

WORKDIR /src
# Dependencies first (a layer that survives source changes), then the project itself.
COPY pyproject.toml README.md ./
RUN mkdir pdserve && touch pdserve/__init__.py \
    && pip install ${TORCH_INDEX:+--extra-index-url $TORCH_INDEX} . \
    && pip uninstall -y pdserve \
    && rm -rf pdserve build ./*.egg-info
COPY pdserve ./pdserve
RUN pip install --no-deps /src && rm -rf /src

USER 1000:1000
WORKDIR /home/pdserve
# router 8000, prefill 8100, decode 8200, operator health 8080
EXPOSE 8000 8100 8200 8080
ENTRYPOINT ["pdserve"]
CMD ["--help"]
