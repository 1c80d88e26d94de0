"""The schemathesis CLI, as docs/openapi.md runs it, against `pdserve serve`: the router's document (in front of a
prefill and a decode engine) and a colocated engine's, every check at its defaults (`--checks all`), no operation
or check left out. Only the limits across fields that JSON Schema cannot state are kept out of the generated
requests (cross_field_hooks.py, the list in docs/openapi.md). A small context and few choices per request keep
every answer quick on a CPU; schemathesis runs in a temporary folder, so its files stay out of the work tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.launcher import free_port
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.processes import Process, server_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

HOOKS = Path(__file__).with_name("cross_field_hooks.py")
# The longest answer is then 16 choices of 127 tokens: seconds, within schemathesis's wait for an answer.
SERVE_FLAGS = ("--max-model-len", "128", "--max-pending-requests", "16", "--kv-cache-memory", "64MiB")
MAX_EXAMPLES = 30  # per operation in the fuzzing phase; the coverage phase runs its cases whatever this is


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_schemathesis_finds_nothing(mode, tmp_path):
    model = ensure_demo_model()  # the user's cache, as `pdserve serve` without --model uses it
    port = free_port()
    argv = ["serve", "--mode", mode, "--port", str(port), "--device", "cpu", *SERVE_FLAGS]
    server = Process(f"pdserve serve --mode {mode}", argv, server_env(), port, tmp_path / "serve.log")
    server.start()
    try:
        server.wait_healthy(300)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "all",
                "--max-examples",
                str(MAX_EXAMPLES),
                # Only how long to wait for an answer: this machine may be busy with other work.
                "--request-timeout",
                "60",
                "--no-color",
            ],
            cwd=tmp_path,  # .schemathesis/ and anything else it writes
            env=dict(os.environ, SCHEMATHESIS_HOOKS=str(HOOKS), PDSERVE_FUZZ_TOKENIZER=str(model)),
            capture_output=True,
            text=True,
            timeout=1200,
        )
    finally:
        server.stop(60)
    report = result.stdout[-12000:] + result.stderr[-3000:]
    assert result.returncode == 0, f"schemathesis against {mode}:\n{report}\n{server.log()}"
    assert "No issues found" in result.stdout, report
