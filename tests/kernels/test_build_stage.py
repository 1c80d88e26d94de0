"""The Dockerfile's build stage, rehearsed where there is no Docker daemon: ``docker/build-venv.sh`` (the
script the Dockerfile runs) makes a fresh venv from a copy of what the Docker context holds, installs
pdserve into it (not editable: the kernels' sources must come with the package) and compiles the
kernels. Then the image's assumption: in that venv the kernels load with no compiler anywhere and
torch's extension directory stays empty. Then this test's own installation and the fresh one start
in turns, as two venvs on one machine do: neither compiles, neither build changes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import build, cpu_kernels

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
CONTEXT = ("pyproject.toml", "README.md", "pdserve", "docker/build-venv.sh")  # .dockerignore's exceptions
LOAD = "from pdserve.kernels.cpu_kernels import cpu_ops; print(cpu_ops().__file__)"


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stdout[-3000:] + "\n" + done.stderr[-3000:]).strip()


def test_the_build_stage_makes_a_venv_whose_kernels_load_without_a_compiler(tmp_path):
    source = tmp_path / "src"
    for name in CONTEXT:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    venv = tmp_path / "venv"
    ours = {build.DIR_ENV, cpu_kernels.VARIANT_ENV, "PYTHONPATH", "VIRTUAL_ENV"}
    env = {key: value for key, value in os.environ.items() if key not in ours}
    # python3 is the interpreter running this test (with its headers), as the Dockerfile's is its base's.
    env["PATH"] = f"{Path(sys.base_prefix) / 'bin'}{os.pathsep}{env['PATH']}"
    for step in ("deps", "project"):
        done = subprocess.run(
            ["sh", str(source / "docker" / "build-venv.sh"), step, str(venv), str(source)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=3000,
        )
        assert done.returncode == 0, _tail(done)
    assert "avx512 (-march=x86-64-v4): built in" in done.stdout and "avx2 (-march=x86-64-v3): built in" in done.stdout

    # The runtime stage: no compiler on PATH or in CXX, a fresh TORCH_EXTENSIONS_DIR; pdserve from the venv.
    (no_tools := tmp_path / "bin").mkdir()
    (extensions := tmp_path / "torch_extensions").mkdir()
    runtime = {**env, "PATH": str(no_tools), "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(extensions)}
    fresh = [str(venv / "bin" / "python"), "-c", LOAD]
    done = subprocess.run(fresh, env=runtime, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "compiling" not in done.stderr, _tail(done)
    fresh_library = Path(done.stdout.strip())
    assert fresh_library.is_relative_to(venv / "lib" / "pdserve-kernels")

    # Two venvs, starts in turns: this test's installation (its build where build.root() says) and the fresh one.
    assert cpu_kernels.cpu_ops() is not None
    this_library = Path(cpu_kernels.cpu_ops().__file__)
    this = [sys.executable, "-c", LOAD]
    this_env = {**runtime, "PYTHONPATH": str(REPO), build.DIR_ENV: os.environ.get(build.DIR_ENV, "")}
    before = {path: path.stat().st_mtime_ns for path in (this_library, fresh_library)}
    for _ in range(2):
        for command, command_env, library in ((this, this_env, this_library), (fresh, runtime, fresh_library)):
            done = subprocess.run(command, env=command_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and "compiling" not in done.stderr, _tail(done)
            assert Path(done.stdout.strip()) == library
    assert {path: path.stat().st_mtime_ns for path in before} == before
    assert [p.name for p in this_library.parent.iterdir() if p.suffix == ".so"] == [this_library.name]
    assert list(extensions.iterdir()) == []
