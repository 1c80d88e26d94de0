"""The C++ CPU kernels are built at install and only loaded at start (``pdserve/kernels/build.py``): the
loader's choice of variant, a start that compiles nothing and writes nowhere when they are built, the
fallback that compiles (and says so) when they are not, the build step's command line, and the
sources shipping with a non-editable install."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from pdserve.kernels import build, cpu_kernels

REPO = Path(__file__).resolve().parents[2]

# /proc/cpuinfo flags of the two CPUs the project runs on: an AMD EPYC with AVX2 only, an Intel Xeon with AVX-512.
EPYC = build.AVX2.cpu_flags | {"sse2", "sha_ni", "clzero"}
XEON = build.AVX512.cpu_flags | {"avx512_vnni", "avx512_bf16", "amx_tile"}


def test_the_loader_picks_the_best_variant_the_cpu_runs():
    assert cpu_kernels.choose_variant(XEON) is build.AVX512
    assert cpu_kernels.choose_variant(EPYC) is build.AVX2
    # Neither (an old x86, an ARM host, no /proc/cpuinfo): a build for the host itself, at first use.
    assert cpu_kernels.choose_variant(frozenset({"fp", "asimd"})) is build.NATIVE
    assert cpu_kernels.choose_variant(frozenset()) is build.NATIVE
    assert cpu_kernels.choose_variant(XEON, "avx2") is build.AVX2  # pinned: what AVX2 hosts get
    with pytest.raises(RuntimeError, match="lacks avx512bw avx512cd avx512dq avx512f avx512vl"):
        cpu_kernels.choose_variant(EPYC, "avx512")  # it would die of SIGILL
    with pytest.raises(ValueError, match="not one of avx512, avx2, native"):
        cpu_kernels.choose_variant(XEON, "x86-64-v3")


def test_each_variant_is_compiled_for_its_instruction_set(kernel_variant):
    ops = cpu_kernels.cpu_ops()
    assert {"avx512": ("avx512", 16), "avx2": ("avx2", 8)}[kernel_variant.name] == (ops.ISA, ops.VECTOR_FLOATS)
    assert Path(ops.__file__) == build.library_path(kernel_variant)


def test_builds_belong_to_the_installation_and_their_key_names_no_path(monkeypatch):
    monkeypatch.delenv(build.DIR_ENV, raising=False)
    assert build.root().is_relative_to(Path(sys.prefix) / "lib" / "pdserve-kernels")
    # The key is what decides whether a build is current: the same in every venv with this torch, so a
    # venv never finds another's build stale (and a venv never looks in another's directory anyway).
    assert build.build_key(build.AVX2) != build.build_key(build.AVX512)
    flags = build._compile_flags(build.AVX2) + build._link_flags()
    assert not [flag for flag in flags if "/" in flag]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != cpu_kernels.VARIANT_ENV}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def test_with_prebuilt_kernels_a_start_compiles_nothing_and_writes_nowhere(tmp_path):
    """What ``pdserve serve`` does on an installation built by ``make setup`` or the Dockerfile: no compiler
    on PATH nor in CXX, and torch's extension directory stays empty."""
    assert cpu_kernels.cpu_ops() is not None  # built here (at install, or by this call)
    (no_tools := tmp_path / "bin").mkdir()
    (extensions := tmp_path / "torch_extensions").mkdir()
    code = "from pdserve.kernels.cpu_kernels import cpu_ops; ops = cpu_ops(); print(ops.ISA, ops.__file__)"
    env = _clean_env(PATH=str(no_tools), CXX="/bin/false", TORCH_EXTENSIONS_DIR=str(extensions))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "compiling" not in done.stderr and "unavailable" not in done.stderr, done.stderr
    isa, path = done.stdout.split()
    assert Path(path) == build.library_path(cpu_kernels.choose_variant(build.host_cpu_flags()))
    assert isa == cpu_kernels.cpu_ops().ISA
    assert list(extensions.iterdir()) == []


@pytest.mark.slow
def test_without_a_build_a_start_compiles_one_into_the_installation_and_says_so(tmp_path):
    """The fallback: one variant (the pinned AVX2 here, which every CI CPU runs), compiled at the first
    start, into the installation's directory (never torch's shared cache); an older build replaced;
    the next start loads it without a compiler."""
    kernels = tmp_path / "kernels"
    variant_dir = kernels / f"torch-{torch.__version__}" / "avx2"
    variant_dir.mkdir(parents=True)
    (variant_dir / "pdserve_cpu_kernels_avx2-0123456789abcdef.so").touch()  # sources changed since
    (variant_dir / ".build-killed").mkdir()  # a build killed midway
    (extensions := tmp_path / "torch_extensions").mkdir()
    code = "from pdserve.kernels.cpu_kernels import cpu_ops; print(cpu_ops().__file__)"
    env = _clean_env(
        **{build.DIR_ENV: str(kernels), cpu_kernels.VARIANT_ENV: "avx2", "TORCH_EXTENSIONS_DIR": str(extensions)}
    )
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "CPU kernels (avx2) out of date" in first.stderr and "run `pdserve build-kernels`" in first.stderr
    assert [p.name for p in variant_dir.iterdir() if p.name != ".lock"] == [Path(first.stdout.strip()).name]
    again = subprocess.run(
        [sys.executable, "-c", code], env={**env, "CXX": "/bin/false"}, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and again.stdout == first.stdout and "compiling" not in again.stderr
    assert list(extensions.iterdir()) == []


def test_the_build_step_skips_current_builds_and_fails_plainly_without_a_compiler(tmp_path, monkeypatch, capsys):
    assert cpu_kernels.cpu_ops() is not None
    best = cpu_kernels.choose_variant(build.host_cpu_flags())
    assert build.main(["--variant", best.name]) == 0
    assert capsys.readouterr().out.startswith(f"{best.name} (-march={best.march}): up to date: ")
    monkeypatch.setenv(build.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert build.main(["--variant", "avx2"]) == 1
    assert "avx2: no C++ compiler" in capsys.readouterr().err


def test_a_non_editable_install_carries_the_sources():
    """The build step compiles the installed package's csrc/: pyproject's package data must name every file."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["pdserve.kernels"]
    package = REPO / "pdserve" / "kernels"
    shipped = {path for pattern in patterns for path in package.glob(pattern)}
    assert {path for path in build.SOURCES.iterdir() if path.suffix in (".cpp", ".h")} <= shipped
