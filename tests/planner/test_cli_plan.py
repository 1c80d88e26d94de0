"""`pdserve profile` and `pdserve plan` as a user runs them: real processes, files, exit codes.
In make test-slow (a minute and a half); tests/planner/test_planner.py covers the planner in make test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from pdserve.planner.profile import Profile
from pdserve.testing.processes import server_env
from tests.planner.test_planner import profile

pytestmark = pytest.mark.slow


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=timeout, env=server_env(2)
    )


@pytest.fixture()
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    profile().save(path)
    return path


def plan(profile_file, *options: str) -> subprocess.CompletedProcess:
    """`pdserve plan` on 15 s of a short-request workload; `options` add to or override the defaults
    (argparse keeps the last value of a flag)."""
    workload = ["--rate", "20", "--duration", "15", "--prompt-len", "200", "--output-len", "40"]
    slo = ["--ttft-ms", "300", "--tpot-ms", "20"]
    return pdserve("plan", "--profile", str(profile_file), *workload, *slo, *options)


def test_plan_prints_both_plans_and_the_sensitivity(profile_file):
    run = plan(profile_file)
    assert run.returncode == 0, run.stderr
    assert "disaggregated: " in run.stdout and "colocated: " in run.stdout
    assert "rate x2:" in run.stdout and "steps/s" in run.stdout
    report = json.loads(plan(profile_file, "--output", "json").stdout)
    assert report["disaggregated"]["attained"] >= 0.9
    assert [row["rate_factor"] for row in report["sensitivity"]] == [0.5, 0.75, 1.25, 1.5, 2.0]


def test_plan_writes_a_sized_pdservice(profile_file, tmp_path):
    base = tmp_path / "pds.yaml"
    manifest = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDService", "metadata": {"name": "llm"}}
    base.write_text(yaml.safe_dump({**manifest, "spec": {"image": "pdserve:1"}}))
    run = plan(profile_file, "--rate", "40", "--tpot-ms", "15", "--output", "pdservice", "--pdservice", str(base))
    assert run.returncode == 0, run.stderr
    sized = yaml.safe_load(run.stdout)
    assert sized["spec"]["image"] == "pdserve:1"
    assert sized["spec"]["prefill"]["replicas"] >= 1 and sized["spec"]["decode"]["replicas"] >= 1


def test_plan_refuses_bad_input_clearly(profile_file, tmp_path):
    missing = plan(tmp_path / "none.json")
    assert missing.returncode == 2 and "pdserve plan:" in missing.stderr and "Traceback" not in missing.stderr
    too_long = plan(profile_file, "--prompt-len", "5000", "--prompt-cv", "0")
    assert too_long.returncode == 2 and "max_model_len" in too_long.stderr
    hopeless = plan(profile_file, "--ttft-ms", "0.01", "--tpot-ms", "0.01", "--max-prefill", "1", "--max-decode", "1")
    assert hopeless.returncode == 1 and "nothing within the limits meets it" in hopeless.stdout


def test_plan_takes_tier_hits_with_their_bandwidth(profile_file):
    unpriced = plan(profile_file, "--tier-hit-rate", "0.5")
    assert unpriced.returncode == 2 and "--tier-bandwidth" in unpriced.stderr and "Traceback" not in unpriced.stderr
    priced = plan(profile_file, "--tier-hit-rate", "0.5", "--tier-bandwidth", "8GiB", "--output", "json")
    assert priced.returncode == 0, priced.stderr
    assert json.loads(priced.stdout)["disaggregated"]["attained"] >= 0.9


def test_profile_measures_the_demo_model(tmp_path):
    out = tmp_path / "demo.json"
    run = pdserve(
        "profile",
        "--device",
        "cpu",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "128",
        "--kv-cache-memory",
        "16MiB",
        "--kv-transfer",
        "tcp",
        "-o",
        str(out),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    measured = Profile.load(out)
    assert measured.engine.max_num_batched_tokens == 128 and measured.engine.kv_bytes_per_token > 0
    assert len(measured.step_points) >= 20 and len(measured.transfer_points) == 9
    assert measured.gpus_per_pod == 0 and measured.hardware.startswith("cpu: ")
    # The fit explains the measured steps: the median step within 50% (a shared 2-core machine is noisy).
    assert measured.step.median_error(measured.step_points) < 0.5
    assert "median error" in run.stdout
    planned = pdserve(
        "plan",
        "--profile",
        str(out),
        "--rate",
        "2",
        "--duration",
        "30",
        "--prompt-len",
        "100",
        "--output-len",
        "20",
        "--ttft-ms",
        "2000",
        "--tpot-ms",
        "200",
    )
    assert planned.returncode == 0, planned.stderr
