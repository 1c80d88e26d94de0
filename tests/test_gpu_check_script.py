"""bench/gpu_check.py cannot run for real without a GPU; its --dry-run runs every section on CPU
at tiny shapes (Triton interpreted), so the script stays working for the sessions that get one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # 10-40 s
def test_a_run_stopped_at_its_bound_keeps_the_sections_it_finished(tmp_path):
    """bench/gpu_check.sh's time bound (290 s on a GPU; seconds here): the sections done before it are in the
    JSON and the Markdown table, the one it stopped in and those after it marked not reached, and the exit
    status says it was stopped. How long the dry run's sections take depends on the machine, so the bound is
    tried from short to long until one falls after the first section and before the last (worker_process, in
    between, starts worker processes that die with their parent)."""
    sections = ["kernels", "worker_process", "parity"]
    for limit in (6, 9, 12, 16, 22):
        out = tmp_path / str(limit)
        env = dict(os.environ, GPU_CHECK_LIMIT_S=str(limit), PYTHON=sys.executable)
        command = ["bash", "bench/gpu_check.sh", str(out), "--dry-run", "--sections", ",".join(sections)]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        finished = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
        done = [name for name in sections if name in finished]
        if result.returncode == 124 and done:
            break
        assert result.returncode in (0, 124), result.stdout[-3000:]
    else:
        raise AssertionError("no bound fell between the first section and the end of the run")
    assert f"stopped at the {limit} s limit" in result.stdout, result.stdout[-3000:]
    assert done == sections[: len(done)] and len(done) < len(sections) and finished["kernels"]["passed"] is True
    table = (out / "gpu_check.md").read_text()
    assert "| kernels | passed |" in table, table
    assert all(f"| {name} | not reached |" in table for name in sections[len(done) :]), table


@pytest.mark.slow  # 22 s: the script's logic, checked with every long suite
def test_gpu_check_dry_run_passes_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    for section in ("kernels", "moe_kernel", "parity", "worker_process", "pd"):
        assert report[section].get("passed") is True, (section, report[section], result.stdout[-3000:])
    # Speed targets are the GPU's: on CPU (Triton interpreted) these sections only have to run.
    assert "kv_read_gbps" in report["attention_bandwidth"], report["attention_bandwidth"]
    assert "step_ms" in report["decode_step"]["batch_8"], report["decode_step"]
    graphs = report["cuda_graphs"]  # the padded path without capture: tokens must match, times are not judged
    assert graphs.get("passed") is True and "graphs_batch_1_ms" in graphs, graphs
    fp8 = report["kv_fp8"]  # on CPU through the reference path: capacity and agreement measured, not judged
    assert fp8.get("capacity_ratio", 0) > 3.9 and fp8.get("positions", 0) > 8 * 32, fp8  # prompts and outputs
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| pd | passed |" in table and "| cuda_graphs | passed |" in table, table
    assert result.returncode == 0, result.stdout[-3000:]
