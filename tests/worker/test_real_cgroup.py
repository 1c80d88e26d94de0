"""An engine started inside real cgroups with a CPU quota and a memory limit, as a Kubernetes pod with
``limits.cpu: 1500m`` and ``limits.memory`` is (the kernel's cgroup v1 controllers of this machine, which Debian's
and most container hosts mount; the unit tests of tests/worker/test_cpu_budget.py read fake cgroup trees of v1, v2
and hybrid hosts).

The test makes a child cgroup of its own in each of the ``cpu`` and ``memory`` hierarchies, starts ``pdserve
serve --mode colocated`` inside both, and reads what the engine chose: one compute thread for 1.5 CPUs (the floor
of a fractional quota), and a KV cache sized from what the memory limit leaves after the weights and the margin,
told in its log and its /metrics. Needs root and writable cgroup v1 ``cpu`` and ``memory`` folders (skipped, with
the reason, elsewhere)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from pdserve.launcher import free_port
from pdserve.testing.cgroups import Cgroups, Unavailable, limited
from pdserve.testing.metrics import metric, scrape
from pdserve.testing.processes import wait_healthy
from pdserve.worker.kv_cache import CPU_MEMORY_MARGIN_BYTES, CPU_MEMORY_MARGIN_SHARE

GIB = 1 << 30
MEMORY_LIMIT = 3 * GIB


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    """1.5 CPUs and 3 GiB, as ``limits.cpu: 1500m`` and ``limits.memory: 3Gi``."""
    try:
        with limited(cpus=1.5, memory_bytes=MEMORY_LIMIT) as made:
            yield made
    except Unavailable as why:
        pytest.skip(f"needs writable cgroup v1 cpu and memory hierarchies (root on a v1 or hybrid host): {why}")


def test_an_engine_sizes_its_threads_and_kv_cache_from_its_cgroups(cgroups, tmp_path):
    memory = next(folder for folder in cgroups.folders if (folder / "memory.failcnt").exists())
    port = free_port()
    log = tmp_path / "serve.log"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("OMP_NUM_THREADS", None)  # the budget is the cgroup's, not a variable's
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "serve", "--mode", "colocated", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=cgroups.enter,  # the child joins both; pdserve's processes inherit them
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, 180, log=log.read_text)
        values = scrape(url)
        assert metric(values, "pdserve_cpu_compute_threads") == 1, log.read_text()[-3000:]
        assert metric(values, "pdserve_cpu_quota_cores") == 1.5
        assert metric(values, "pdserve_memory_limit_bytes") == MEMORY_LIMIT
        text = log.read_text()
        assert "a CPU quota of 1.5 CPUs (cgroup v1)" in text
        sized = re.search(
            r"KV cache: ([0-9.]+) GiB, what the memory limit leaves \(3\.00 GiB, cgroup v1; ([0-9.]+) GiB", text
        )
        assert sized is not None, text[-3000:]
        kv_gib, in_use_gib = float(sized.group(1)), float(sized.group(2))
        margin_gib = (CPU_MEMORY_MARGIN_BYTES + MEMORY_LIMIT * CPU_MEMORY_MARGIN_SHARE) / GIB
        assert 0 < kv_gib <= 3.0 - in_use_gib - margin_gib + 0.01
        # And it serves under the limit.
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as answer:
            model = json.loads(answer.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200
        assert int((memory / "memory.failcnt").read_text()) == 0  # never pushed against its limit
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
