"""Who may start without the cluster secret: `pdserve prefill|decode|router` as a user runs them (real processes).

Without a secret only loopback addresses are allowed; any other refuses to start with a message naming the fix,
unless --kv-insecure; an unreadable or short secret is a clear error, not a silent fallback to no secret."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.api.auth import SECRET_ENV
from pdserve.testing.processes import server_env


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or server_env(),
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("prefill", "--host", "0.0.0.0"),
        ("decode", "--kv-side-channel-host", "10.1.2.3"),
        ("router", "--host", "0.0.0.0", "--decode", "http://127.0.0.1:1"),
    ],
)
def test_a_non_loopback_address_without_a_secret_refuses_to_start(argv):
    result = _run(*argv)
    assert result.returncode != 0
    assert "without a KV secret" in result.stderr and "--kv-secret-file" in result.stderr, result.stderr


def test_a_short_or_missing_secret_is_a_clear_error(tmp_path):
    short = tmp_path / "short"
    short.write_text("tiny\n")
    result = _run("prefill", "--kv-secret-file", str(short))
    assert result.returncode != 0 and "at least 16" in result.stderr, result.stderr
    result = _run("router", "--kv-secret-file", str(tmp_path / "absent"), "--decode", "http://127.0.0.1:1")
    assert result.returncode != 0 and "cannot read the KV secret file" in result.stderr, result.stderr
    result = _run("decode", env=dict(server_env(), **{SECRET_ENV: "short"}))
    assert result.returncode != 0 and SECRET_ENV in result.stderr, result.stderr
