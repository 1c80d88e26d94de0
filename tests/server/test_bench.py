"""pdserve bench against a real colocated server, and its workload/arrival generators."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.bench.loadgen import BenchConfig, arrival_offsets, make_workload


def test_bench_cli_reports_vllm_style_figures(server, tmp_path):
    result_file = tmp_path / "result.json"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "bench",
            "--base-url",
            server.running.url,
            "--model",
            "demo",
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "6",
            "--max-concurrency",
            "4",
            "--ignore-eos",
            "--slo-ttft-ms",
            "60000",
            "--slo-tpot-ms",
            "60000",
            "--result-filename",
            str(result_file),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(result_file.read_text())
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert summary["total_output_tokens"] == 48 and summary["total_input_tokens"] == 8 * 16
    for key in (
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_itl_ms",
        "median_e2el_ms",
        "request_throughput",
        "output_throughput",
        "goodput",
    ):
        assert summary[key] > 0, key
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # generous SLOs: all good
    assert "Time to first token" in completed.stdout


def test_bench_chat_workload_and_failures_are_counted(server, tmp_path):
    import asyncio

    from pdserve.bench.loadgen import run_benchmark

    chat = asyncio.run(
        run_benchmark(
            BenchConfig(
                server.running.url,
                "demo",
                num_prompts=3,
                output_len=4,
                workload="chat",
                progress=False,
                ignore_eos=True,
            )
        )
    )
    assert chat["completed"] == 3
    wrong_model = asyncio.run(
        run_benchmark(BenchConfig(server.running.url, "nope", num_prompts=2, output_len=2, progress=False))
    )
    assert (wrong_model["completed"], wrong_model["failed"]) == (0, 2)
    assert "HTTP 404" in wrong_model["errors"][0]


def test_workloads_and_arrivals_are_seeded():
    config = BenchConfig(
        "http://x",
        "m",
        num_prompts=12,
        input_len=8,
        output_len=4,
        workload="shared-prefix",
        prefix_len=20,
        num_prefixes=3,
    )
    prompts = [r.prompt_token_ids for r in make_workload(config)]
    assert len({tuple(p[:20]) for p in prompts}) == 3 and all(len(p) == 28 for p in prompts)
    assert prompts == [r.prompt_token_ids for r in make_workload(config)]
    poisson = arrival_offsets(1000, 50.0, "poisson", seed=1)
    assert poisson == arrival_offsets(1000, 50.0, "poisson", seed=1)
    assert 15 < poisson[-1] < 25  # about 1000 / 50 s
    assert arrival_offsets(3, 2.0, "fixed", 0) == [0.0, 0.5, 1.0]
    assert arrival_offsets(3, float("inf"), "poisson", 0) == [0.0, 0.0, 0.0]
