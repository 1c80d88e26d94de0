"""The Dockerfile and .dockerignore, read statically (no image is built here: see tests/e2e)."""

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


def test_dockerfile_runs_pdserve_as_uid_1000() -> None:
    steps = instructions()
    commands = [name for name, _ in steps]
    assert commands[0] == "ARG" and steps[0][1].startswith("BASE_IMAGE=nvidia/cuda:")
    assert ("FROM", "${BASE_IMAGE}") in steps
    assert any(arg.startswith("TORCH_INDEX=") for name, arg in steps if name == "ARG")
    assert commands.count("FROM") == 1
    users = [arg for name, arg in steps if name == "USER"]
    assert users == ["1000:1000"]
    assert commands.index("USER") > max(i for i, name in enumerate(commands) if name in {"RUN", "COPY"})
    assert ("ENTRYPOINT", '["pdserve"]') in steps
    run = " ".join(arg for name, arg in steps if name == "RUN")
    assert "useradd --uid 1000" in run and "--create-home --home-dir /home/pdserve" in run
    assert "HOME=/home/pdserve" in " ".join(arg for name, arg in steps if name == "ENV")
    assert "${TORCH_INDEX:+--extra-index-url $TORCH_INDEX}" in run


def test_dockerignore_sends_only_the_package() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"  # everything out (.git, .venv, tests, caches) ...
    assert {p for p in patterns if p.startswith("!")} == {"!pyproject.toml", "!README.md", "!pdserve/"}
    assert {"**/__pycache__", "**/*.egg-info", "**/.pytest_cache"} <= set(patterns)
    copied = {arg.split()[0] for name, arg in instructions() if name == "COPY"}
    assert copied == {"pyproject.toml", "pdserve"}  # README.md comes with the first COPY (two sources)


def test_chart_app_version_matches_the_package() -> None:
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert helm_python.Chart.load(REPO / "helm" / "pdserve").metadata["appVersion"] == version
