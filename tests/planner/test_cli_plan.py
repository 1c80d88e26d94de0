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


def test_plan_prints_both_plans_and_the_sensitivity(profile_file):
    run = pdserve(
        "plan",
        "--profile",
        str(profile_file),
        "--rate",
        "20",
        "--duration",
        "30",
        "--prompt-len",
        "200",
        "--output-len",
        "40",
        "--ttft-ms",
        "300",
        "--tpot-ms",
        "20",
    )
    assert run.returncode == 0, run.stderr
    assert "disaggregated: " in run.stdout and "colocated: " in run.stdout
    assert "rate x2:" in run.stdout and "steps/s" in run.stdout
    as_json = pdserve(
        "plan",
        "--profile",
        str(profile_file),
        "--rate",
        "20",
        "--duration",
        "30",
        "--ttft-ms",
        "300",
        "--tpot-ms",
        "20",
        "--output",
        "json",
        "--prompt-len",
        "200",
        "--output-len",
        "40",
    )
    report = json.loads(as_json.stdout)
    assert report["disaggregated"]["attained"] >= 0.9
    assert [row["rate_factor"] for row in report["sensitivity"]] == [0.5, 0.75, 1.25, 1.5, 2.0]


def test_plan_writes_a_sized_pdservice(profile_file, tmp_path):
    base = tmp_path / "pds.yaml"
    base.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "pdserve.io/v1alpha1",
                "kind": "PDService",
                "metadata": {"name": "llm"},
                "spec": {"image": "pdserve:1"},
            }
        )
    )
    run = pdserve(
        "plan",
        "--profile",
        str(profile_file),
        "--rate",
        "40",
        "--duration",
        "20",
        "--ttft-ms",
        "200",
        "--tpot-ms",
        "15",
        "--output",
        "pdservice",
        "--pdservice",
        str(base),
        "--prompt-len",
        "200",
        "--output-len",
        "40",
    )
    assert run.returncode == 0, run.stderr
    manifest = yaml.safe_load(run.stdout)
    assert manifest["spec"]["image"] == "pdserve:1"
    assert manifest["spec"]["prefill"]["replicas"] >= 1 and manifest["spec"]["decode"]["replicas"] >= 1


def test_plan_refuses_bad_input_clearly(profile_file, tmp_path):
    missing = pdserve("plan", "--profile", str(tmp_path / "none.json"), "--ttft-ms", "1", "--tpot-ms", "1")
    assert missing.returncode == 2 and "pdserve plan:" in missing.stderr and "Traceback" not in missing.stderr
    too_long = pdserve(
        "plan",
        "--profile",
        str(profile_file),
        "--prompt-len",
        "5000",
        "--prompt-cv",
        "0",
        "--ttft-ms",
        "1",
        "--tpot-ms",
        "1",
        "--duration",
        "5",
    )
    assert too_long.returncode == 2 and "max_model_len" in too_long.stderr
    hopeless = pdserve(
        "plan",
        "--profile",
        str(profile_file),
        "--rate",
        "5",
        "--duration",
        "10",
        "--ttft-ms",
        "0.01",
        "--tpot-ms",
        "0.01",
        "--max-prefill",
        "1",
        "--max-decode",
        "1",
    )
    assert hopeless.returncode == 1 and "nothing within the limits meets it" in hopeless.stdout


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
