"""``kernel_variant``: a test of the C++ CPU kernels runs once per instruction-set variant pdserve ships,
each loaded as a start loads it (the build made at install by ``make setup``; compiled first where
there is none); a variant this CPU cannot run is skipped, and the reason says which flags it lacks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.kernels import build, cpu_kernels


@pytest.fixture(params=[variant.name for variant in build.SHIPPED])
def kernel_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[build.Variant]:
    variant = build.VARIANTS[request.param]
    host = build.host_cpu_flags()
    if not variant.runs_on(host):
        pytest.skip(f"this CPU cannot run the {variant.name} kernels: no {' '.join(sorted(variant.cpu_flags - host))}")
    monkeypatch.setenv(cpu_kernels.VARIANT_ENV, variant.name)
    cpu_kernels.cpu_ops.cache_clear()
    ops = cpu_kernels.cpu_ops()
    assert ops is not None, "the C++ kernels must build on these machines (the log above says why not)"
    assert variant.name == ops.ISA  # compiled for the instruction set it is named after
    yield variant
    cpu_kernels.cpu_ops.cache_clear()  # the next test loads what its environment asks for
