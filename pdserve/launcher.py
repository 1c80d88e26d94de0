"""``pdserve serve`` in disaggregated mode: router + N prefill + M decode engines as child
processes on one host, supervised.

Each child is the same command a pod runs (``pdserve prefill|decode|router``), with free ports
picked here, the engine flags forwarded, and the CPU cores split between the engines (each gets
its own cores, and torch as many threads, when there are enough cores). The launcher waits for
every engine's /health before starting the router, prints the router URL, and on Ctrl-C, SIGTERM
or the death of any child stops every child (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from pdserve.api.http import base_url
from pdserve.api.roles import DECODE, PREFILL, ROUTER

logger = logging.getLogger("pdserve.launcher")

STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, and never one this process handed out before: the probe's port is free
    again once the probe closes, so two calls in a row can name the same port (seen in CI: a prefill
    and a decode told to serve on one port; both bound it, the decode listened first and took the
    prefill's requests). A port handed out is bound later by the child given it; until then only
    this record keeps it from being handed out again."""
    while True:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def split_cores(ranks: list[int]) -> list[list[int]] | None:
    """Disjoint core sets, one per engine, in proportion to its ``ranks`` (tensor-parallel size), when
    there are enough cores for every rank; else None (every engine shares them all)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < sum(ranks) or len(ranks) < 2:
        return None
    share = len(cores) // sum(ranks)
    starts = [sum(ranks[:index]) * share for index in range(len(ranks))]
    return [cores[start : start + count * share] for start, count in zip(starts, ranks, strict=True)]


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    url: str


def _start(name: str, command: list[str], cores: list[int] | None, url: str, ranks: int = 1) -> Child:
    """Start a child on ``cores`` (None: anywhere), its threads shared by its ``ranks`` worker processes."""
    env = dict(os.environ)
    preexec = None
    if cores is not None:
        env["OMP_NUM_THREADS"] = str(max(1, len(cores) // ranks))

        def preexec() -> None:
            os.sched_setaffinity(0, cores)

    process = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *command], env=env, preexec_fn=preexec)
    logger.info("started %s (pid %d)%s", name, process.pid, f" on cores {cores}" if cores else "")
    return Child(name, process, url)


def _wait_healthy(children: list[Child], deadline: float, stopping: list[bool]) -> None:
    pending = list(children)
    while pending:
        if stopping[0]:
            raise KeyboardInterrupt
        for child in list(pending):
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited during start-up (exit code {child.process.returncode})")
            try:
                with urllib.request.urlopen(f"{child.url}/health", timeout=2) as response:
                    if response.status == 200:
                        pending.remove(child)
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy after {STARTUP_TIMEOUT_S:.0f} s: {', '.join(c.name for c in pending)}")
        time.sleep(0.2)


def _stop(children: list[Child]) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s: killing it", child.name, STOP_GRACE_S)
            child.process.kill()
            child.process.wait()


def run_disaggregated(
    host: str,
    port: int,
    num_prefill: int,
    num_decode: int,
    engine_argv: list[str],
    router_argv: list[str],
    tp_sizes: dict[str, int] | None = None,
    disk_tier: str | None = None,
) -> int:
    """Start everything, serve until a signal or a child's death; returns the exit code. ``tp_sizes``:
    each role's tensor-parallel size (default 1); ``disk_tier``: a folder in which each engine keeps its
    local disk tier, in a subfolder of its name."""
    sizes = {PREFILL.name: 1, DECODE.name: 1, **(tp_sizes or {})}
    stopping = [False]

    def on_signal(signum: int, _frame: object) -> None:
        stopping[0] = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        roles = [PREFILL.name] * num_prefill + [DECODE.name] * num_decode
        split = split_cores([sizes[role] for role in roles])
        core_sets: list[list[int] | None] = list(split) if split else [None] * len(roles)
        counts = {PREFILL.name: 0, DECODE.name: 0}
        for role, cores in zip(roles, core_sets, strict=True):
            engine_port = free_port(host)
            name = f"{role}-{counts[role]}"
            counts[role] += 1
            tp = ["--tensor-parallel-size", str(sizes[role])] if sizes[role] > 1 else []
            command = [role, "--host", host, "--port", str(engine_port), *engine_argv, *tp]
            if disk_tier is not None:
                command += ["--kv-tier-disk", os.path.join(disk_tier, name)]
            children.append(_start(name, command, cores, base_url(host, engine_port), sizes[role]))
        _wait_healthy(children, time.monotonic() + STARTUP_TIMEOUT_S, stopping)
        urls = {role: [c.url for c in children if c.name.startswith(role)] for role in counts}
        router_url = base_url(host, port)
        router = _start(
            ROUTER,
            [
                ROUTER,
                "--host",
                host,
                "--port",
                str(port),
                "--prefill",
                *urls[PREFILL.name],
                "--decode",
                *urls[DECODE.name],
                *router_argv,
            ],
            None,
            router_url,
        )
        children.append(router)
        _wait_healthy([router], time.monotonic() + 60, stopping)
        print(
            f"pdserve (disaggregated: {num_prefill} prefill at TP {sizes[PREFILL.name]}, {num_decode} decode at "
            f"TP {sizes[DECODE.name]}) serving at {router_url}/v1",
            flush=True,
        )
        while not stopping[0]:
            dead = next((c for c in children if c.process.poll() is not None), None)
            if dead is not None:
                logger.error("%s exited (code %s): stopping everything", dead.name, dead.process.returncode)
                return 1
            time.sleep(0.2)
        logger.info("shutting down: stopping the router and the engines")
        return 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as error:
        logger.error("%s", error)
        return 1
    finally:
        _stop(list(reversed(children)))
        for signum, handler in previous.items():
            signal.signal(signum, handler)
