"""`pdserve` server processes for tests and benchmarks, as pods run them: each on a port of 127.0.0.1 with its
output in a log file; started, waited for until /health answers, stopped with SIGTERM (SIGKILL if it hangs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.api.keys import KEYS_ENV
from pdserve.launcher import free_port


def server_env(threads: int = 1) -> dict[str, str]:
    """This process's environment for a server that shares a small machine: ``threads`` OpenMP threads that wait
    passively at once (tests run several servers on two cores: one spinning after its step would take a core
    from the next), no injected KV faults and no key folder (both asked per process)."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="0", OMP_NUM_THREADS=str(threads))
    env.pop("PDSERVE_KV_FAULTS", None)
    env.pop(KEYS_ENV, None)
    return env


# How the test suites' engines run their model: uni (in the core's process), mp (a worker process) or
# async (a worker process, with async scheduling). make test-slow runs the P/D and LLM suites again
# with mp and with async.
TEST_EXECUTOR_ENV = "PDSERVE_TEST_EXECUTOR"
TEST_EXECUTORS = ("uni", "mp", "async")


def engine_executor() -> dict[str, str | bool]:
    """The engine settings for the tests' executor (``PDSERVE_TEST_EXECUTOR``, default uni)."""
    name = os.environ.get(TEST_EXECUTOR_ENV, "uni")
    if name not in TEST_EXECUTORS:
        raise ValueError(f"{TEST_EXECUTOR_ENV} must be one of {', '.join(TEST_EXECUTORS)}, got {name!r}")
    return {"distributed_executor_backend": "uni" if name == "uni" else "mp", "async_scheduling": name == "async"}


def cpu_engine_flags(kv_cache_memory: str, max_model_len: int = 512, served_model_name: str = "demo") -> list[str]:
    """An engine's flags for a CPU run beside others: a KV cache of ``kv_cache_memory`` (e.g. "8MiB"), warnings only,
    on the tests' executor (``engine_executor``)."""
    executor = engine_executor()
    return [
        "--distributed-executor-backend",
        str(executor["distributed_executor_backend"]),
        "--async-scheduling" if executor["async_scheduling"] else "--no-async-scheduling",
        "--device",
        "cpu",
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory",
        kv_cache_memory,
        "--served-model-name",
        served_model_name,
        "--log-level",
        "warning",
    ]


def engine_argv(role: str, port: int, model: str, *flags: str, transport: str = "nixl") -> list[str]:
    """A P/D engine's command line (after `pdserve`), with a free port of its own for the KV side channel."""
    side_channel = str(free_port())
    return [
        role,
        "--port",
        str(port),
        "--model",
        model,
        "--kv-transfer",
        transport,
        "--kv-side-channel-port",
        side_channel,
        *flags,
    ]


def router_argv(port: int, prefill: Sequence[str], decode: Sequence[str], *flags: str) -> list[str]:
    """A router's command line (after `pdserve`) over these pods' URLs (no prefill pods: decode-only)."""
    argv = ["router", "--port", str(port), "--log-level", "warning", *flags]
    if prefill:
        argv += ["--prefill", *prefill]
    return [*argv, "--decode", *decode]


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``url`` answers /health with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return response.status == 200
    except OSError:  # refused, timed out, or an HTTP error status
        return False


def wait_healthy(
    url: str, process: subprocess.Popen, timeout: float = 180.0, name: str = "", log: Callable[[], str] = str
) -> None:
    """Wait until ``url`` is healthy; RuntimeError (with ``log()``) when ``process`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if process.poll() is not None:
            raise RuntimeError(f"{name or url} exited with {process.returncode}:\n{log()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name or url} not healthy after {timeout:g} s:\n{log()}")
        time.sleep(0.2)


@dataclass
class Process:
    """`python -m pdserve.cli ARGV` (ARGV holds ``--port PORT``) in ``env``, its output appended to ``log_path``;
    pinned to the CPUs ``cores`` (taskset's list, e.g. "0,1") when given; reached at ``host`` (a loopback
    address: another one than 127.0.0.1 stands for a pod's IP)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: str | Path
    process: subprocess.Popen | None = None
    cores: str | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        pin = ["taskset", "-c", self.cores] if self.cores else []
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [*pin, sys.executable, "-m", "pdserve.cli", *self.argv],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def healthy(self) -> bool:
        return healthy(self.url, timeout=5)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        assert self.process is not None, f"{self.name} was not started"
        wait_healthy(self.url, self.process, timeout, self.name, self.log)

    def log(self, size: int = 5000) -> str:
        """The end of the process's output."""
        with open(self.log_path, errors="replace") as handle:
            return handle.read()[-size:]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (engines drain what they run first), SIGKILL after ``timeout`` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
