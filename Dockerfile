# syntax=docker/dockerfile:1
# One image for the operator, the router and the engines: `pdserve operator|router|prefill|decode`.
#
#   GPU (default base):  docker build -t pdserve:0.1.0 .
#   CPU:                 docker build -t pdserve:0.1.0-cpu --build-arg BASE_IMAGE=python:3.11-slim \
#                            --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
#
# Any base with python3 >= 3.11, or an Ubuntu/Debian one without Python, works (see docs/kubernetes.md).
# Two stages on the same base: `build` makes the venv and compiles pdserve's C++ CPU kernels into it
# (docker/build-venv.sh); the image copies that venv and carries no C++ compiler.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build

# Extra package index for torch. Empty: PyPI, whose Linux x86_64 torch is the CUDA build. The CPU
# index makes the pinned torch==2.13.0 resolve to 2.13.0+cpu (no CUDA libraries, ~2 GB smaller).
ARG TORCH_INDEX=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++ for the kernels (every shipped instruction set, whatever this host's CPU: pdserve/kernels/build.py);
# Python, with its headers, where the base has none (the CUDA images).
# hadolint ignore=DL3008,SC2086
RUN packages="g++" \
    && if ! command -v python3 >/dev/null; then packages="$packages python3 python3-venv python3-dev"; fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Dependencies first (a layer that survives source changes), then the project and its kernels.
COPY docker/build-venv.sh pyproject.toml README.md ./
RUN TORCH_INDEX="$TORCH_INDEX" sh build-venv.sh deps /opt/pdserve /src
COPY pdserve ./pdserve
RUN sh build-venv.sh project /opt/pdserve /src

FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH \
    HOME=/home/pdserve \
    OMP_WAIT_POLICY=PASSIVE

# Python where the base has none (the CUDA images): the venv's interpreter is the base's, as in `build`.
# No C++ compiler: the CPU kernels come built, in the venv. On a CUDA base, a C compiler (gcc, libc6-dev)
# and Python's headers all the same: Triton (3.x, 3.9 included) compiles its CUDA driver module
# (triton/backends/nvidia/driver.c) with `cc` at a process's first GPU kernel, into ~/.triton/cache,
# and cannot be made to do it here: the module's cache key includes where the host's libcuda.so.1 is,
# which no build host without the GPU driver has. (The per-kernel launcher stubs it compiled before
# are gone since mid-2025, triton-lang/triton#6788: one launcher in that module serves every kernel.)
# Then the non-root user, uid/gid 1000 (Ubuntu 24.04 images already hold an "ubuntu" user with that
# uid: it goes).
# hadolint ignore=DL3008,SC2086
RUN packages="" \
    && if ! command -v python3 >/dev/null; then packages="python3"; fi \
    && if [ -n "${CUDA_VERSION:-}" ]; then packages="$packages gcc libc6-dev python3-dev"; fi \
    && if [ -n "$packages" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $packages && rm -rf /var/lib/apt/lists/*; \
    fi \
    && { userdel --remove ubuntu 2>/dev/null || true; } \
    && { groupdel ubuntu 2>/dev/null || true; } \
    && groupadd --gid 1000 pdserve \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/pdserve --shell /bin/sh pdserve

COPY --from=build /opt/pdserve /opt/pdserve

USER 1000:1000
WORKDIR /home/pdserve
# router 8000, prefill 8100, decode 8200, operator health 8080
EXPOSE 8000 8100 8200 8080
ENTRYPOINT ["pdserve"]
CMD ["--help"]
