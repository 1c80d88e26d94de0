"""Real P/D clusters for tests: `pdserve prefill|decode|router` processes on 127.0.0.1, as pods run
them, plus small HTTP and metrics helpers. A test module starts its cluster once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pdserve.launcher import free_port
from pdserve.models.demo import ensure_demo_model

ENGINE_FLAGS = [
    "--device",
    "cpu",
    "--max-model-len",
    "512",
    "--kv-cache-memory",
    "8MiB",
    "--served-model-name",
    "demo",
    "--log-level",
    "warning",
]


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: str
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *self.argv], env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"{self.name} exited:\n{self.log()}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{self.name} not healthy:\n{self.log()}"
            time.sleep(0.2)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as handle:
            return handle.read()[-5000:]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Cluster:
    prefills: list[Process] = field(default_factory=list)
    decodes: list[Process] = field(default_factory=list)
    router: Process | None = None

    @classmethod
    def start(
        cls,
        tmp_path,
        transport: str = "nixl",
        num_prefill: int = 1,
        num_decode: int = 1,
        prefill_flags: tuple[str, ...] = (),
        decode_flags: tuple[str, ...] = (),
        decode_faults: str = "",
        with_router: bool = True,
    ) -> Cluster:
        model = str(ensure_demo_model())
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
        env.pop("PDSERVE_KV_FAULTS", None)
        cluster = cls()
        for role, count, flags in (("prefill", num_prefill, prefill_flags), ("decode", num_decode, decode_flags)):
            role_env = dict(env, PDSERVE_KV_FAULTS=decode_faults) if role == "decode" and decode_faults else env
            for index in range(count):
                port = free_port()
                argv = [
                    role,
                    "--port",
                    str(port),
                    "--model",
                    model,
                    "--kv-transfer",
                    transport,
                    "--kv-side-channel-port",
                    str(free_port()),
                    *ENGINE_FLAGS,
                    *flags,
                ]
                process = Process(f"{role}-{index}", argv, role_env, port, str(tmp_path / f"{role}-{index}.log"))
                (cluster.prefills if role == "prefill" else cluster.decodes).append(process)
        try:
            for process in cluster.prefills + cluster.decodes:
                process.start()
            for process in cluster.prefills + cluster.decodes:
                process.wait_healthy()
            if with_router:
                port = free_port()
                cluster.router = Process(
                    "router",
                    [
                        "router",
                        "--port",
                        str(port),
                        "--log-level",
                        "warning",
                        "--prefill",
                        *[p.url for p in cluster.prefills],
                        "--decode",
                        *[d.url for d in cluster.decodes],
                    ],
                    env,
                    port,
                    str(tmp_path / "router.log"),
                )
                cluster.router.start()
                cluster.router.wait_healthy()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def stop(self) -> None:
        for process in [self.router, *self.prefills, *self.decodes]:
            if process is not None:
                process.stop()


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {series (with labels): value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def wait_for(condition, timeout: float, message: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, message
        time.sleep(interval)
