#!/bin/sh
# The image's venv, as the Dockerfile's build stage makes it; tests/kernels/test_build_stage.py runs the same
# script where there is no Docker daemon, so the two cannot drift.
#
#   build-venv.sh deps VENV SRC     a venv with pdserve's dependencies (the Dockerfile's layer that survives
#                                   source changes): SRC needs only pyproject.toml and README.md
#   build-venv.sh project VENV SRC  pdserve from SRC, then its C++ CPU kernels compiled into the venv
#                                   (needs a C++ compiler and Python's headers; the runtime stage needs neither)
#
# TORCH_INDEX: an extra package index for torch (the Dockerfile's build argument; empty: PyPI's torch).
set -eu
step=$1 venv=$2 src=$3
case $step in
deps)
    python3 -m venv "$venv"
    # The dependencies alone: install a placeholder package with pdserve's metadata, then remove it.
    stub=$(mktemp -d)
    cp "$src/pyproject.toml" "$src/README.md" "$stub"
    mkdir "$stub/pdserve" && touch "$stub/pdserve/__init__.py"
    "$venv/bin/pip" install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$stub"
    "$venv/bin/pip" uninstall -y pdserve
    rm -rf "$stub"
    ;;
project)
    "$venv/bin/pip" install --no-deps "$src"
    "$venv/bin/python" -m pdserve.kernels.build
    ;;
*)
    echo "usage: $0 deps|project VENV SRC" >&2
    exit 2
    ;;
esac
