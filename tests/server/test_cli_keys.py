"""Who may start without keys, and with which keys: `pdserve prefill|decode|router|keys` as a user runs them (real
processes).

Without keys only loopback addresses are allowed; any other refuses to start with a message naming the fix, unless
--kv-insecure. A key folder missing a role's files, or holding a malformed key, is a clear error naming the file,
not a silent fallback to no keys. `pdserve keys` makes a folder, refuses to overwrite one, and takes a rollover one
step at a time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.api import keys
from pdserve.api.keys import KEYS_ENV
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
def test_a_non_loopback_address_without_keys_refuses_to_start(argv):
    result = _run(*argv)
    assert result.returncode != 0
    assert "without keys" in result.stderr and "--kv-keys" in result.stderr, result.stderr


def test_a_folder_without_a_roles_keys_or_with_a_bad_one_is_a_clear_error(tmp_path):
    bundle = keys.new_bundle()
    router_only, engine_only = tmp_path / "router", tmp_path / "engine"
    keys.write_bundle(router_only, bundle, keys.ROUTER_FILES)
    keys.write_bundle(engine_only, bundle, keys.ENGINE_FILES)
    result = _run("prefill", "--kv-keys", str(router_only))
    assert result.returncode != 0 and "lacks router.pub, engine.key" in result.stderr, result.stderr
    result = _run("router", "--kv-keys", str(engine_only), "--decode", "http://127.0.0.1:1")
    assert result.returncode != 0 and "lacks router.key" in result.stderr, result.stderr
    result = _run("decode", env=dict(server_env(), **{KEYS_ENV: str(tmp_path / "absent")}))
    assert result.returncode != 0 and "does not exist" in result.stderr, result.stderr
    (engine_only / "engine.key").write_text("0123\n")
    result = _run("decode", "--kv-keys", str(engine_only))
    assert result.returncode != 0 and "engine.key:1" in result.stderr and "32 bytes" in result.stderr, result.stderr


def test_pdserve_keys_makes_a_folder_and_rotates_it_step_by_step(tmp_path):
    folder = tmp_path / "keys"
    result = _run("keys", str(folder))
    assert result.returncode == 0, result.stderr
    keys.check_folder(folder, keys.ALL_FILES, "test")
    first = keys.read_bundle(folder)
    result = _run("keys", str(folder))
    assert result.returncode == 2 and "holds keys already" in result.stderr  # never overwritten
    for step, lines in (("add", 2), ("promote", 2), ("retire", 1)):
        result = _run("keys", str(folder), "--rotate", step)
        assert result.returncode == 0, result.stderr
        assert all(len(text.split()) == lines for text in keys.read_bundle(folder).values()), step
    last = keys.read_bundle(folder)
    assert all(last[name] != first[name] for name in keys.ALL_FILES)
