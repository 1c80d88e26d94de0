"""The CPU and memory a CPU engine may really use: its CPU affinity, its cgroup's CPU quota and memory limit
(cgroup v2 ``cpu.max``, ``memory.max``; v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``,
``memory.limit_in_bytes``), and the compute threads chosen from them.

Why: a pod's affinity is the whole node unless the kubelet pins CPUs (static CPU manager policy), so without
this an engine with ``limits.cpu: 4`` on a 64-core node runs 64 OpenMP threads into a 4-CPU CFS quota and is
throttled every period (every OpenMP barrier waits for a descheduled thread); and a KV cache of a fixed size
in a pod with a tight ``limits.memory`` is an OOM kill where a smaller cache would have served.

Threads: an explicit ``--cpu-threads`` wins, then ``OMP_NUM_THREADS`` (per process, as OpenMP reads it); else
the smaller of the affinity and the quota, a fractional quota rounded down (1500m: 1 thread; a thread that
gets half a CPU per period holds every barrier up), at least one. From 4 CPUs up, one is left to the API
process, the engine core's own thread and the transfer agent, which share the cgroup.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
RESERVE_FROM_CPUS = 4  # budgets of at least this many CPUs leave one to the API process and the agent
_V1_UNLIMITED = 1 << 62  # v1 writes "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class CgroupLimits:
    """What the process's cgroup (and its ancestors, the tightest of each) allows; None: no limit found."""

    cpu_quota: float | None = None  # CPUs per period
    memory_limit: int | None = None  # bytes
    memory_usage: int | None = None  # bytes charged to the cgroup now
    source: str = "none"  # "cgroup v2", "cgroup v1" or "none"


@dataclass(frozen=True)
class CpuBudget:
    threads: int  # compute threads per process (each tensor-parallel rank)
    reason: str  # how they were chosen, for the start log
    affinity: int  # CPUs the process may run on
    limits: CgroupLimits
    detected: bool = True  # from affinity and quota (a ThreadGovernor may follow contention), not given


def read_cgroup_limits(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> CgroupLimits:
    """The CPU quota and memory limit of this process's cgroup, v2 or v1; CgroupLimits() where neither is
    readable (not Linux, no cgroup filesystem)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return CgroupLimits()
    controllers: dict[str, str] = {}  # v1 controller -> the process's path in its hierarchy
    unified = None  # the process's path in the v2 hierarchy
    for line in lines:
        _, names, path = line.split(":", 2)
        if names == "":
            unified = path
        for name in names.split(","):
            controllers[name] = path
    # A hybrid host mounts v1 controllers beside an empty v2 hierarchy: the v1 ones hold the limits.
    if "cpu" in controllers or "memory" in controllers:
        return _v1(root, controllers)
    if unified is not None:
        return _v2(root, unified)
    return CgroupLimits()


def _ancestors(base: Path, path: str) -> list[Path]:
    """``base``/``path`` and each parent up to ``base``, those that exist (inside a container's cgroup
    namespace the path is often "/", or names the host's folder, which is not there: then ``base`` alone)."""
    parts = [part for part in path.split("/") if part]
    folders = [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [folder for folder in folders if folder.is_dir()]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _tightest(values: list[float | int]) -> float | int | None:
    return min(values) if values else None


def _v2(root: Path, path: str) -> CgroupLimits:
    quotas: list[float | int] = []
    limits: list[float | int] = []
    usage = None
    for folder in _ancestors(root, path):
        cpu_max = (_read(folder / "cpu.max") or "max").split()
        if cpu_max[0] != "max" and len(cpu_max) == 2 and int(cpu_max[1]) > 0:
            quotas.append(int(cpu_max[0]) / int(cpu_max[1]))
        memory_max = _read(folder / "memory.max")
        if memory_max is not None and memory_max != "max":
            limits.append(int(memory_max))
        if usage is None:
            current = _read(folder / "memory.current")
            usage = int(current) if current is not None else None
    memory_limit = _tightest(limits)
    return CgroupLimits(_tightest(quotas), None if memory_limit is None else int(memory_limit), usage, "cgroup v2")


def _v1(root: Path, controllers: dict[str, str]) -> CgroupLimits:
    quotas: list[float | int] = []
    limits: list[float | int] = []
    usage = None
    cpu_base = next((root / name for name in ("cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
    if cpu_base is not None and "cpu" in controllers:
        for folder in _ancestors(cpu_base, controllers["cpu"]):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota is not None and period is not None and int(quota) > 0 and int(period) > 0:
                quotas.append(int(quota) / int(period))
    if (root / "memory").is_dir() and "memory" in controllers:
        for folder in _ancestors(root / "memory", controllers["memory"]):
            limit = _read(folder / "memory.limit_in_bytes")
            if limit is not None and int(limit) < _V1_UNLIMITED:
                limits.append(int(limit))
            if usage is None:
                used = _read(folder / "memory.usage_in_bytes")
                usage = int(used) if used is not None else None
    memory_limit = _tightest(limits)
    return CgroupLimits(_tightest(quotas), None if memory_limit is None else int(memory_limit), usage, "cgroup v1")


def choose_threads(
    explicit: int | None,
    tp_size: int = 1,
    environ: dict[str, str] | None = None,
    affinity: int | None = None,
    limits: CgroupLimits | None = None,
) -> CpuBudget:
    """The compute threads of each of an engine's ``tp_size`` processes (see the module's docstring)."""
    environ = dict(os.environ) if environ is None else environ
    affinity = len(os.sched_getaffinity(0)) if affinity is None else affinity
    limits = read_cgroup_limits() if limits is None else limits
    if explicit is not None:
        return CpuBudget(max(1, explicit // tp_size), f"--cpu-threads {explicit}", affinity, limits, detected=False)
    given = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if given.isdigit() and int(given) > 0:
        return CpuBudget(int(given), f"OMP_NUM_THREADS={given}", affinity, limits, detected=False)
    cpus = affinity
    reason = f"{affinity} CPUs in the affinity mask"
    if limits.cpu_quota is not None and int(limits.cpu_quota) < affinity:
        cpus = max(1, int(limits.cpu_quota))
        reason = f"a CPU quota of {limits.cpu_quota:g} CPUs ({limits.source}) under {affinity} CPUs of affinity"
    if cpus >= RESERVE_FROM_CPUS:
        cpus -= 1
        reason += ", one left to the API process and the transfer agent"
    return CpuBudget(max(1, cpus // tp_size), reason, affinity, limits)


PROC_STAT = Path("/proc/stat")
GOVERNOR_WINDOW_S = 1.0  # how often the CPUs' use is read
GOVERNOR_AGREEMENT = 2  # windows in a row that must ask for the same smaller thread count (more: one window)
# A window in which the engine itself used less CPU than this mostly waited (between requests): what others did
# then says nothing of what its steps compete with, so the window decides nothing.
GOVERNOR_MIN_OWN_CPUS = 0.5


def engine_cpu_seconds() -> float:
    """CPU time of this process and of its parent: the API process that feeds the engine is not a competitor
    (its bursts as a batch arrives made the governor drop a thread on a quiet machine)."""
    own = sum(os.times()[:2])
    try:
        fields = Path(f"/proc/{os.getppid()}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return own
    return own + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Fewer compute threads while other processes take the CPUs this engine runs on, all of them again once
    those are free: checked between steps, one window (``GOVERNOR_WINDOW_S``) at a time.

    Why: a parallel kernel's threads meet at a barrier after each kernel, ~60 times a decode step. When another
    busy process shares the cores, the scheduler deschedules one of them for a while, and the others wait for
    it at the barrier - spinning (``GOMP_SPINCOUNT``, which pays on a quiet machine) and so taking CPU from the
    very thread they wait for. Measured on 2 cores beside one busy process (docs/benchmarks.md): 2 spinning
    threads gave 31% of the quiet throughput at batch 64 and 17% at batch 1; one thread, 52% and 89% of its own
    quiet figure. So: threads = the CPUs of the affinity mask that others leave (their use measured from
    /proc/stat; the engine's own, this process's and its API process's, from their CPU times), rounded, between
    1 and ``ceiling``. Fewer threads need ``GOVERNOR_AGREEMENT`` windows in a row, more one; a window in which the
    engine mostly waited (``GOVERNOR_MIN_OWN_CPUS``: it ticks only between steps, so its first window after a
    pause spans the pause and whatever ran in it) decides nothing.
    """

    def __init__(
        self,
        ceiling: int,
        set_threads: Callable[[int], None],
        cpus: Collection[int] | None = None,
        stat_path: Path = PROC_STAT,
        clock: Callable[[], float] = time.monotonic,
        own_cpu_seconds: Callable[[], float] = engine_cpu_seconds,
    ) -> None:
        self.ceiling = ceiling
        self.threads = ceiling
        self._set_threads = set_threads
        self._cpus = {f"cpu{cpu}" for cpu in (os.sched_getaffinity(0) if cpus is None else cpus)}
        self._stat_path = stat_path
        self._clock = clock
        self._own_cpu_seconds = own_cpu_seconds
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, float, float] | None = None  # (time, busy CPU-seconds of our CPUs, own)
        self._wanted: tuple[int, int] = (ceiling, 0)  # (a thread count asked for, windows in a row)
        self._sample()

    def tick(self) -> None:
        """Between steps: once a window has passed, read the CPUs' use and follow it."""
        if self._last is None or self._clock() - self._last[0] < GOVERNOR_WINDOW_S:
            return
        previous = self._last
        self._sample()
        if self._last is None:
            return
        elapsed = self._last[0] - previous[0]
        own = (self._last[2] - previous[2]) / elapsed
        if own < GOVERNOR_MIN_OWN_CPUS:
            self._wanted = (self.threads, 0)
            return
        others = max(0.0, (self._last[1] - previous[1]) / elapsed - own)
        wanted = min(self.ceiling, max(1, round(len(self._cpus) - others)))
        count = self._wanted[1] + 1 if wanted == self._wanted[0] else 1
        self._wanted = (wanted, count)
        # Fewer threads only on agreement (a burst of another process must not halve a batch), more at once: a
        # window that finds the CPUs free again is clear, and every window spent short of threads costs.
        if wanted > self.threads or (wanted < self.threads and count >= GOVERNOR_AGREEMENT):
            cpus = len(self._cpus)
            logger.info("compute threads %d -> %d: others take %.1f of %d CPUs", self.threads, wanted, others, cpus)
            self.threads = wanted
            self._set_threads(wanted)

    def _sample(self) -> None:
        try:
            lines = self._stat_path.read_text().splitlines()
        except OSError:
            self._last = None  # no /proc/stat: the governor stays out of the way
            return
        busy = 0
        for line in lines:
            name, _, fields = line.partition(" ")
            if name in self._cpus:
                values = [int(value) for value in fields.split()]
                busy += sum(values) - values[3] - (values[4] if len(values) > 4 else 0)  # all but idle, iowait
        self._last = (self._clock(), busy / self._tick, self._own_cpu_seconds())
