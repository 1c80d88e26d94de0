"""A CPU engine's threads and KV cache from its real budget, read from fake cgroup file trees (v2, v1, a hybrid
host, no limit; a fractional quota; a quota in an ancestor; affinity narrower than the quota; explicit
settings), as /proc/self/cgroup and /sys/fs/cgroup show them; then a real engine process whose start log and
/metrics say what it chose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.worker.cpu_budget import (
    CgroupLimits,
    ThreadGovernor,
    choose_threads,
    read_cgroup_limits,
)
from pdserve.worker.kv_cache import (
    CPU_MEMORY_MARGIN_BYTES,
    CPU_MEMORY_MARGIN_SHARE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    cpu_kv_budget,
)

GIB = 1 << 30


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def _limits(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> CgroupLimits:
    root = _tree(tmp_path / "sys", files)
    (tmp_path / "cgroup").write_text(proc_cgroup)
    return read_cgroup_limits(root, tmp_path / "cgroup")


def test_cgroup_v2_quota_and_memory(tmp_path):
    limits = _limits(
        tmp_path,
        "0::/\n",
        {"cpu.max": "150000 100000", "memory.max": str(4 * GIB), "memory.current": str(GIB)},
    )
    assert limits == CgroupLimits(cpu_quota=1.5, memory_limit=4 * GIB, memory_usage=GIB, source="cgroup v2")


def test_cgroup_v2_without_limits(tmp_path):
    limits = _limits(tmp_path, "0::/\n", {"cpu.max": "max 100000", "memory.max": "max", "memory.current": "5"})
    assert (limits.cpu_quota, limits.memory_limit, limits.memory_usage) == (None, None, 5)


def test_cgroup_v2_takes_the_tightest_of_the_process_cgroup_and_its_ancestors(tmp_path):
    limits = _limits(
        tmp_path,
        "0::/kubepods/pod1/engine\n",
        {
            "kubepods/pod1/cpu.max": "400000 100000",  # the pod's limit
            "kubepods/pod1/memory.max": str(8 * GIB),
            "kubepods/pod1/engine/cpu.max": "max 100000",
            "kubepods/pod1/engine/memory.max": "max",
            "kubepods/pod1/engine/memory.current": str(2 * GIB),
            "kubepods/cpu.max": "1600000 100000",
        },
    )
    assert limits == CgroupLimits(cpu_quota=4.0, memory_limit=8 * GIB, memory_usage=2 * GIB, source="cgroup v2")


def test_cgroup_v1_quota_and_memory_in_a_container_namespace(tmp_path):
    # The paths name the host's folders, which a container does not see: its own cgroup is the mount's root.
    limits = _limits(
        tmp_path,
        "4:memory:/kubepods/pod1/abc\n2:cpu,cpuacct:/kubepods/pod1/abc\n1:name=systemd:/\n",
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "250000",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
            "memory/memory.limit_in_bytes": str(3 * GIB),
            "memory/memory.usage_in_bytes": str(GIB),
        },
    )
    assert limits == CgroupLimits(cpu_quota=2.5, memory_limit=3 * GIB, memory_usage=GIB, source="cgroup v1")


def test_cgroup_v1_without_limits_on_a_hybrid_host(tmp_path):
    # v1 controllers beside an empty v2 hierarchy (this machine's layout): the v1 files hold the limits.
    limits = _limits(
        tmp_path,
        "4:memory:/\n1:cpu:/\n0::/\n",
        {
            "cpu/cpu.cfs_quota_us": "-1",
            "cpu/cpu.cfs_period_us": "100000",
            "memory/memory.limit_in_bytes": "9223372036854771712",
            "memory/memory.usage_in_bytes": "7",
        },
    )
    assert limits == CgroupLimits(memory_usage=7, source="cgroup v1")


def test_no_cgroup_file_means_no_limits(tmp_path):
    assert read_cgroup_limits(tmp_path, tmp_path / "missing") == CgroupLimits()


@pytest.mark.parametrize(
    ("explicit", "environ", "affinity", "quota", "tp", "threads", "reason"),
    [
        (None, {}, 64, 4.0, 1, 3, "a CPU quota of 4 CPUs"),  # 4 CPUs: one left to the API process
        (None, {}, 64, 1.5, 1, 1, "a CPU quota of 1.5 CPUs"),  # 1500m rounds down
        (None, {}, 64, 0.5, 1, 1, "a CPU quota of 0.5 CPUs"),  # never none
        (None, {}, 2, 4.0, 1, 2, "2 CPUs in the affinity mask"),  # affinity narrower than the quota
        (None, {}, 3, None, 1, 3, "3 CPUs in the affinity mask"),  # no quota, under 4: all of them
        (None, {}, 16, None, 2, 7, "16 CPUs in the affinity mask, one left"),  # 15 between two ranks
        (None, {"OMP_NUM_THREADS": "5"}, 64, 4.0, 1, 5, "OMP_NUM_THREADS=5"),  # the environment wins
        (6, {"OMP_NUM_THREADS": "5"}, 64, 4.0, 2, 3, "--cpu-threads 6"),  # the flag wins, split by rank
    ],
)
def test_threads_from_the_budget(explicit, environ, affinity, quota, tp, threads, reason):
    budget = choose_threads(explicit, tp, environ, affinity, CgroupLimits(cpu_quota=quota, source="cgroup v2"))
    assert budget.threads == threads
    assert budget.reason.startswith(reason)


def test_the_kv_cache_never_outgrows_the_memory_limit():
    assert cpu_kv_budget(1, CgroupLimits()) == DEFAULT_CPU_KV_CACHE_BYTES  # no limit
    roomy = CgroupLimits(memory_limit=64 * GIB, memory_usage=GIB, source="cgroup v2")
    assert cpu_kv_budget(1, roomy) == DEFAULT_CPU_KV_CACHE_BYTES
    tight = CgroupLimits(memory_limit=3 * GIB, memory_usage=GIB, source="cgroup v2")
    margin = CPU_MEMORY_MARGIN_BYTES + int(3 * GIB * CPU_MEMORY_MARGIN_SHARE)
    assert cpu_kv_budget(1, tight) == 2 * GIB - margin
    assert cpu_kv_budget(2, tight) == (2 * GIB - margin) // 2  # each rank its share
    full = CgroupLimits(memory_limit=GIB, memory_usage=GIB, source="cgroup v1")
    with pytest.raises(ValueError, match=r"leaves no room for a KV cache.*--kv-cache-memory"):
        cpu_kv_budget(1, full)


class _Machine:
    """A fake /proc/stat for two CPUs, a clock and this process's CPU time, advanced one window at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.now = 0.0
        self.own = 0.0
        self.busy = [0, 0]  # jiffies (1/100 s) of each CPU
        self.write()

    def write(self) -> None:
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for cpu, busy in enumerate(self.busy):
            lines.append(f"cpu{cpu} {busy} 0 0 {10_000 - busy} 7 0 0 0 0 0")
        lines.append("cpu7 999999 0 0 0 0 0 0 0 0 0")  # not in the affinity mask: never counted
        self.path.write_text("\n".join(lines) + "\n")

    def governor(self, ceiling: int) -> tuple[ThreadGovernor, list[int]]:
        """A governor of this machine's CPUs 0 and 1, and the thread counts it applies."""
        applied: list[int] = []
        clock, own = (lambda: self.now), (lambda: self.own)
        governor = ThreadGovernor(ceiling, applied.append, [0, 1], self.path, clock, own)
        return governor, applied

    def second(self, own: float, others: float, seconds: float = 1.0) -> None:
        """``seconds`` in which this process used ``own`` CPUs and other processes ``others``."""
        self.now += seconds
        self.own += own * seconds
        share = (own + others) * 100 * seconds / 2
        self.busy = [busy + int(share) for busy in self.busy]
        self.write()


def test_the_governor_takes_threads_back_while_others_use_the_cpus(tmp_path):
    machine = _Machine(tmp_path / "stat")
    governor, applied = machine.governor(ceiling=2)
    machine.second(own=2.0, others=0.0)  # quiet: both threads
    governor.tick()
    assert applied == []
    machine.second(own=1.0, others=1.0)  # a busy process beside it: one window is not enough
    governor.tick()
    assert applied == [] and governor.threads == 2
    machine.second(own=1.0, others=1.0)
    governor.tick()
    assert applied == [1] and governor.threads == 1
    governor.tick()  # within the window: nothing read
    machine.second(own=1.0, others=0.2)  # the CPUs free again (a little use of others is no contention): at once
    governor.tick()
    assert applied == [1, 2] and governor.threads == 2


def test_the_governor_never_goes_past_its_ceiling_or_below_one(tmp_path):
    machine = _Machine(tmp_path / "stat")
    governor, applied = machine.governor(ceiling=1)
    for _ in range(3):
        machine.second(own=0.5, others=1.5)
        governor.tick()
    assert applied == [] and governor.threads == 1
    missing = ThreadGovernor(2, applied.append, cpus=[0], stat_path=tmp_path / "none")
    missing.tick()  # no /proc/stat: it stays out of the way
    assert missing.threads == 2


def test_a_window_in_which_the_engine_mostly_waited_decides_nothing(tmp_path):
    """It ticks only between steps: its first window after a pause spans the pause, and whatever ran in it (another
    server's burst, in bench/vs_vllm.py) is no competition for its steps."""
    machine = _Machine(tmp_path / "stat")
    governor, applied = machine.governor(ceiling=2)
    machine.second(own=2.0, others=0.0)
    governor.tick()
    machine.second(own=0.1, others=1.8, seconds=20)  # idle while another process ran
    governor.tick()
    machine.second(own=1.1, others=0.9)  # the first second of its next batch, beside that process's tail
    governor.tick()
    assert applied == [] and governor.threads == 2  # two agreeing windows needed, the pause was not one
    machine.second(own=1.9, others=0.1)
    governor.tick()
    assert applied == []


def test_the_engines_cpu_time_counts_its_api_process():
    """The parent (the API process that feeds the engine) is the engine's, not a competitor: a child reads this
    process's CPU time into its own."""
    code = "import os; from pdserve.worker.cpu_budget import engine_cpu_seconds as e; print(e() - sum(os.times()[:2]))"
    before = sum(os.times()[:2])
    seen = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    after = sum(os.times()[:2])
    assert before - 0.02 <= seen <= after + 0.02  # (clock ticks of 10 ms)
