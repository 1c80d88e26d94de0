"""Building the C++ CPU kernels (``csrc/``): at install time, for every instruction-set variant pdserve
ships, against the torch installed beside it. ``python -m pdserve.kernels.build`` (``make setup``, the
Dockerfile's build stage, ``pdserve build-kernels``) is the step; ``cpu_kernels.py`` loads the best
variant the CPU runs at process start, and compiles one here only where nothing current was built.

Owns the variants and their compiler flags, where builds live, the key that says a build is current,
and the compiler invocations (the compiler itself: ``$CXX``, default ``c++``; g++ or clang++).

Variants: ``avx512`` (``-march=x86-64-v4``) and ``avx2`` (``-march=x86-64-v3``), explicit levels
rather than ``-march=native``, so that a build made on one x86 CPU runs on every CPU of its level
(a Docker build host is rarely the serving host). A CPU with neither, or not x86, gets ``native``:
compiled on that host at first use, never shipped.

Where: ``<sys.prefix>/lib/pdserve-kernels/torch-<version>/<variant>/`` (``PDSERVE_KERNELS_DIR``
replaces ``<sys.prefix>/lib/pdserve-kernels``). ``sys.prefix`` is the installation (a venv's root), so
a build belongs to the torch it was compiled against and goes away with the venv. Not inside the
package: an editable install's package directory is the source checkout, which other venvs install
too. Each build's file name carries its key: a digest of the sources, the flags, the torch version
and the Python ABI, and of nothing that names a path. That is why two venvs never rebuild each
other's kernels: torch's JIT cache (``~/.cache/torch_extensions``) was one directory per machine
whose ``build.ninja`` named one venv's include paths, so each venv found the other's build stale at
every start; here each venv has its own directory, and even a directory shared on purpose
(``PDSERVE_KERNELS_DIR``) would hold one file per key, each loadable by every installation whose
key it is.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = Path(__file__).parent / "csrc"
DIR_ENV = "PDSERVE_KERNELS_DIR"

# What x86-64-v3 code may use, as /proc/cpuinfo names it (``abm``: LZCNT), v2's included.
_V3_FLAGS = frozenset(
    {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
    | {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
)
_V4_FLAGS = _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its name (``ISA`` in the module, for the shipped ones), the ``-march``
    it is compiled for, and the CPU flags a host needs to run it (empty: the building host's own)."""

    name: str
    march: str
    cpu_flags: frozenset[str]

    @property
    def module(self) -> str:
        """The Python module's name (its ``PyInit_`` symbol): one per variant, so that variants can be
        loaded side by side."""
        return f"pdserve_cpu_kernels_{self.name}"

    def runs_on(self, host_flags: frozenset[str]) -> bool:
        return self.cpu_flags <= host_flags


AVX512 = Variant("avx512", "x86-64-v4", _V4_FLAGS)
AVX2 = Variant("avx2", "x86-64-v3", _V3_FLAGS)
SHIPPED = (AVX512, AVX2)  # best first: the loader takes the first the CPU runs
NATIVE = Variant("native", "native", frozenset())
VARIANTS = {variant.name: variant for variant in (*SHIPPED, NATIVE)}


class BuildError(RuntimeError):
    """No compiler, or the compiler failed (its message is the compiler's output)."""


def host_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as Linux reports them; empty elsewhere (only ``native`` fits then)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def _compile_flags(variant: Variant) -> list[str]:
    # -ffast-math: the kernels never see a non-finite number by design (attention.cpp says why),
    # and it vectorises exp. -fopenmp: ATen's parallel_for is inlined here, as OpenMP; the library
    # then needs libgomp.so.1, which the process already has from torch (torch/lib). Hidden
    # visibility: two variants loaded in one process must not bind to each other's functions.
    return [
        "-std=c++20",
        "-fPIC",
        "-O3",
        f"-march={variant.march}",
        "-ffast-math",
        "-fopenmp",
        "-fvisibility=hidden",
        f"-DTORCH_EXTENSION_NAME={variant.module}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]


def _link_flags() -> list[str]:
    return ["-shared", "-fopenmp", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]


def build_key(variant: Variant) -> str:
    """What a build of ``variant`` depends on, as a digest: the sources, the flags, the torch version
    and the Python ABI (never a path). A ``native`` build also depends on the host's CPU flags: a
    directory moved to another CPU must not load code for instructions that CPU lacks."""
    digest = hashlib.sha256()
    for part in (torch.__version__, sys.implementation.cache_tag, *_compile_flags(variant), *_link_flags()):
        digest.update(part.encode() + b"\0")
    if variant.march == "native":
        digest.update(" ".join(sorted(host_cpu_flags()) or [platform.machine()]).encode())
    for source in sorted(SOURCES.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def root() -> Path:
    """This installation's build directory for the torch it has (see the module's docstring)."""
    base = os.environ.get(DIR_ENV) or Path(sys.prefix) / "lib" / "pdserve-kernels"
    return Path(base) / f"torch-{torch.__version__}"


def library_path(variant: Variant) -> Path:
    """Where the current build of ``variant`` is, or would be."""
    return root() / variant.name / f"{variant.module}-{build_key(variant)}.so"


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    # One builder per variant at a time (engines starting together, or a start during `make setup`).
    # A kernel lock: it goes with its holder, even one killed midway.
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        yield


def _compiler() -> list[str]:
    command = shlex.split(os.environ.get("CXX") or "c++")
    if not command or shutil.which(command[0]) is None:
        raise BuildError(f"no C++ compiler ({command[0] if command else 'CXX is empty'}): install g++ or set CXX")
    return command


def _run(what: str, command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip()
        # The first error first: the one line a log keeps (cpu_ops logs one); the whole output after it.
        first = next((line for line in output.splitlines() if "error" in line), output.partition("\n")[0])
        raise BuildError(f"{what} failed: {first}\n{shlex.join(command)}\n{output}")


def build(variant: Variant, *, force: bool = False, jobs: int | None = None) -> Path:
    """Compile ``variant`` into this installation's directory unless a current build is there already
    (``force``: even then) and return the library's path. The files compile in parallel (``jobs``,
    default one per CPU); older builds of the variant are removed."""
    target = library_path(variant)
    with _locked(target.parent):
        if target.exists() and not force:
            return target
        compiler = _compiler()
        # The include and library paths of the torch and Python this runs on: the loader's own. Imported
        # here: torch's extension module imports setuptools, which a start that only loads need not pay.
        from torch.utils.cpp_extension import include_paths, library_paths

        python_include = sysconfig.get_path("include", scheme="posix_prefix")
        includes = [arg for path in [*include_paths(), python_include] for arg in ("-isystem", path)]
        # The longest file first: on two cores it then overlaps all the others.
        sources = sorted(SOURCES.glob("*.cpp"), key=lambda source: source.name != "bindings.cpp")
        for leftover in target.parent.glob(".build-*"):  # from a build killed midway: ours now (the lock)
            shutil.rmtree(leftover, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch:
            objects = [Path(scratch) / f"{source.stem}.o" for source in sources]
            commands = [
                [*compiler, *_compile_flags(variant), *includes, "-c", str(source), "-o", str(obj)]
                for source, obj in zip(sources, objects, strict=True)
            ]
            with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
                list(pool.map(_run, [f"compiling {source.name}" for source in sources], commands))
            library = Path(scratch) / target.name
            library_dirs = [f"-L{path}" for path in library_paths()]
            _run("linking", [*compiler, *map(str, objects), *library_dirs, *_link_flags(), "-o", str(library)])
            os.replace(library, target)  # atomic: a loader sees the whole file or none
        for old in target.parent.glob(f"{variant.module}-*.so"):
            if old != target:
                old.unlink()  # a process that loaded it keeps its mapping
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m pdserve.kernels.build``: build the shipped variants (or those named) that are not
    current; exit status 1 if one fails."""
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.kernels.build",
        description="Compile pdserve's C++ CPU kernels for this installation (every shipped instruction set).",
    )
    parser.add_argument(
        "--variant",
        action="append",
        choices=sorted(VARIANTS),
        help="build only this variant (repeatable; default: " + ", ".join(v.name for v in SHIPPED) + ")",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even where a current build exists")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiler processes (default: one per CPU)")
    args = parser.parse_args(argv)
    chosen: Sequence[Variant] = [VARIANTS[name] for name in args.variant] if args.variant else SHIPPED
    for variant in chosen:
        started = time.monotonic()
        existed = library_path(variant).exists()
        try:
            path = build(variant, force=args.force, jobs=args.jobs)
        except BuildError as error:
            print(f"{variant.name}: {error}", file=sys.stderr)
            return 1
        state = "up to date" if existed and not args.force else f"built in {time.monotonic() - started:.0f} s"
        print(f"{variant.name} (-march={variant.march}): {state}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
