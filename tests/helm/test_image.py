"""The Dockerfile and .dockerignore, read statically (no image is built here: see tests/e2e; the build
stage's commands run in tests/kernels/test_build_stage.py)."""

from __future__ import annotations

import re
from pathlib import Path

import helm_python

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)  # join continued lines
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in logical.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, one list per FROM (each list starting with it); the ARGs before the
    first FROM are left out."""
    split: list[list[tuple[str, str]]] = []
    for step in instructions():
        if step[0] == "FROM":
            split.append([])
        if split:
            split[-1].append(step)
    return split


def test_dockerfile_runs_pdserve_as_uid_1000() -> None:
    steps = instructions()
    commands = [name for name, _ in steps]
    assert commands[0] == "ARG" and steps[0][1].startswith("BASE_IMAGE=nvidia/cuda:")
    assert [arg for name, arg in steps if name == "FROM"] == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    build, image = stages()
    assert any(arg.startswith("TORCH_INDEX=") for name, arg in build if name == "ARG")
    users = [arg for name, arg in steps if name == "USER"]
    assert users == ["1000:1000"]
    assert commands.index("USER") > max(i for i, name in enumerate(commands) if name in {"RUN", "COPY"})
    assert ("ENTRYPOINT", '["pdserve"]') in image
    run = " ".join(arg for name, arg in image if name == "RUN")
    assert "useradd --uid 1000" in run and "--create-home --home-dir /home/pdserve" in run
    assert "HOME=/home/pdserve" in " ".join(arg for name, arg in image if name == "ENV")
    script = (REPO / "docker" / "build-venv.sh").read_text()
    assert '${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}' in script


def test_the_image_takes_the_venv_built_with_its_kernels_and_no_cpp_compiler() -> None:
    """The build stage runs docker/build-venv.sh (which tests/kernels/test_build_stage.py rehearses) to
    make the venv and compile the C++ CPU kernels into it; the image copies that venv and installs no
    C++ compiler (a C compiler only on a CUDA base, for Triton: the Dockerfile says why)."""
    build, image = stages()
    runs = [arg for name, arg in build if name == "RUN"]
    assert "g++" in runs[0]
    assert runs[1:] == [
        'TORCH_INDEX="$TORCH_INDEX" sh build-venv.sh deps /opt/pdserve /src',
        "sh build-venv.sh project /opt/pdserve /src",
    ]
    assert ("COPY", "--from=build /opt/pdserve /opt/pdserve") in image
    image_runs = " ".join(arg for name, arg in image if name == "RUN")
    assert "g++" not in image_runs and "build-essential" not in image_runs
    assert 'if [ -n "${CUDA_VERSION:-}" ]; then packages="$packages gcc libc6-dev python3-dev"; fi' in image_runs


def test_dockerignore_sends_only_the_package() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"  # everything out (.git, .venv, tests, caches) ...
    assert {p for p in patterns if p.startswith("!")} == {
        "!pyproject.toml",
        "!README.md",
        "!pdserve/",
        "!docker/build-venv.sh",
    }
    assert {"**/__pycache__", "**/*.egg-info", "**/.pytest_cache"} <= set(patterns)
    copied = {arg.split()[0] for name, arg in instructions() if name == "COPY" and not arg.startswith("--from=")}
    assert copied == {"docker/build-venv.sh", "pdserve"}  # pyproject.toml and README.md come with the first COPY


def test_chart_app_version_matches_the_package() -> None:
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert helm_python.Chart.load(REPO / "helm" / "pdserve").metadata["appVersion"] == version
