"""bench/soak.py as a test: 200 mixed requests through a real router + 1P1D cluster, a third of the clients
leaving early; nothing may fail, leak KV blocks, or grow an engine's memory beyond the soak's bound (~30 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_soak_200_requests(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--requests", "200", "--log-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-6000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "soak" and summary["requests"] == 200, summary
    assert summary["ok"] is True and summary["errors"] == 0 and summary["leftover_blocks"] == 0, report[-6000:]
    # The run proved something only if clients both finished and left early.
    assert summary["completed"] > 0 and summary["left"] > 0, summary
