"""Real cgroups for tests and benchmarks: a child of this process's own cgroup in the kernel's v1 ``cpu`` and
``memory`` hierarchies, with a CPU quota and a memory limit, that a child process joins before it runs (as a
Kubernetes pod's containers run under ``limits.cpu`` and ``limits.memory``). Needs root and writable v1
hierarchies (Debian's and most container hosts' hybrid layout); ``Unavailable`` says why not elsewhere."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000


class Unavailable(Exception):
    """No cgroup can be made here (not root, no v1 hierarchy of the controller, or not writable)."""


def own_v1_folder(controller: str, root: Path = ROOT) -> Path:
    """This process's folder in the v1 hierarchy of ``controller``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller not in names.split(","):
            continue
        base = next((root / n for n in (f"{controller},cpuacct", controller) if (root / n).is_dir()), None)
        if base is None:
            break
        folder = base.joinpath(*[part for part in path.split("/") if part])
        if folder.is_dir() and os.access(folder, os.W_OK):
            return folder
        raise Unavailable(f"{folder} is not there or not writable")
    raise Unavailable(f"no cgroup v1 {controller!r} hierarchy for this process")


@dataclass(frozen=True)
class Cgroups:
    folders: tuple[Path, ...]

    def enter(self) -> None:
        """Move the calling process into every folder (a ``preexec_fn``: the child, before it runs)."""
        for folder in self.folders:
            (folder / "cgroup.procs").write_text(str(os.getpid()))


@contextmanager
def limited(cpus: float | None = None, memory_bytes: int | None = None) -> Iterator[Cgroups]:
    """Fresh child cgroups with a CPU quota of ``cpus`` and a memory limit of ``memory_bytes`` (each None: no such
    cgroup); what is still in them at the end is killed, and they are removed."""
    name = f"pdserve-{uuid.uuid4().hex[:8]}"
    wanted = [("cpu", cpus), ("memory", memory_bytes)]
    parents = {controller: own_v1_folder(controller) for controller, value in wanted if value is not None}
    made: list[Path] = []
    try:
        for controller, parent in parents.items():
            folder = parent / name
            try:
                folder.mkdir()
            except OSError as error:
                raise Unavailable(f"cannot make {folder}: {error}") from error
            made.append(folder)
            if controller == "cpu":
                (folder / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                (folder / "cpu.cfs_quota_us").write_text(str(round(cpus * CFS_PERIOD_US)))  # type: ignore[operator]
            else:
                (folder / "memory.limit_in_bytes").write_text(str(memory_bytes))
        yield Cgroups(tuple(made))
    finally:
        for folder in made:
            for pid in (folder / "cgroup.procs").read_text().split():
                with suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _remove(folder)


def _remove(folder: Path) -> None:
    """rmdir, once the killed processes have left it (the kernel refuses while any remains)."""
    for _ in range(100):
        try:
            folder.rmdir()
            return
        except OSError:
            time.sleep(0.05)
    folder.rmdir()
