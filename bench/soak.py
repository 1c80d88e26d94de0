"""Soak test of a local P/D cluster: does anything leak when clients misbehave?

Starts a router, one prefill and one decode engine (`python -m pdserve.cli prefill|decode|router`, demo model,
CPU, free ports), then sends N requests through the router, 16 at a time: completions and chat, prompts of
5-300 tokens (token-id lists or text), 1-64 output tokens, streamed or not. About 60% of the clients read their
answer to the end, 30% disconnect at a random moment of their first 0.5 s (those answered sooner count as
completed), 10% close the connection right after sending the request.

It measures each engine's RSS (its API process plus its children: the engine core and multiprocessing's resource
tracker) and the router's, once the first 10% of the requests (the warm-up) have ended and the cluster is idle,
and again at the end. At the end (waiting up to the KV lease + 10 s, so holds of prefill legs whose decode leg
never came may expire) it checks that the prefill holds no blocks for remote decodes, that no engine owns a KV
block, and that nothing is running, waiting or waiting for remote KV.

With --stop-cycles N the prefill engine (its API process and engine core) is stopped with SIGSTOP N times during
the run, --stop-seconds each, then resumed with SIGCONT: a peer that keeps its sockets open and answers nothing.
Prefill legs then time out and decode computes those prompts; failed prefill legs are expected there, nothing
else is. The cluster runs with a cluster secret, as `pdserve serve` and the operator run it.

ok is true when: every process is alive and healthy, no request failed (anything but a 200 read to its end or a
deliberate disconnect; the router saw no failing leg but those stops cause), nothing leaked, and no process's RSS
grew by more than 64 MiB (--rss-bound-mib) between the warm-up and the end. Exit code 1 otherwise.

Prints a report; the last line is JSON. On a 2-core CPU machine it runs 15-30 s for --requests 200 and 30-50 s
for --requests 1000 (startup ~10 s and the final wait for idle, at most the lease + 10 s, included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.api.keys import ENGINE_FILES, KEYS_ENV, ROUTER_FILES, new_bundle, write_bundle
from pdserve.launcher import free_port
from pdserve.testing.metrics import IDLE_SERIES, ROUTER_LEG_FAILURES, idle, scrape
from pdserve.testing.processes import Process, cpu_engine_flags, engine_argv, router_argv, server_env

LEASE_SECONDS = 5
ENGINE_FLAGS = [*cpu_engine_flags("8MiB"), "--kv-lease-seconds", str(LEASE_SECONDS)]
CONCURRENCY = 16
REQUEST_TIMEOUT_S = 180
# Router leg failures a stopped prefill causes (its legs time out or find no healthy prefill pod): expected
# with --stop-cycles, as long as every request still ends well.
STOPPED_PREFILL_FAILURES = ("prefill_timeout", "prefill_unreachable", "no_prefill")
FIRST_STOP_AFTER_S = 5.0
BETWEEN_STOPS_S = 8.0
# ----- processes ----------------------------------------------------------------------------------------------


def start_cluster(log_dir: Path, transport: str) -> tuple[Process, Process, Process]:
    from pdserve.models.demo import ensure_demo_model

    model = str(ensure_demo_model())
    # One OpenMP thread each and passive waits: two engines share a small machine without spinning on each other.
    bundle = new_bundle()
    write_bundle(log_dir / "keys" / "router", bundle, ROUTER_FILES)
    write_bundle(log_dir / "keys" / "engine", bundle, ENGINE_FILES)
    env = dict(server_env(), **{KEYS_ENV: str(log_dir / "keys" / "engine")})
    router_env = dict(server_env(), **{KEYS_ENV: str(log_dir / "keys" / "router")})
    engines = []
    for role in ("prefill", "decode"):
        port = free_port()
        argv = engine_argv(role, port, model, *ENGINE_FLAGS, transport=transport)
        engines.append(Process(role, argv, env, port, log_dir / f"{role}.log"))
    prefill, decode = engines
    router_port = free_port()
    router = Process(
        "router", router_argv(router_port, [prefill.url], [decode.url]), router_env, router_port, log_dir / "router.log"
    )
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy()
        router.start()
        router.wait_healthy()
    except BaseException:
        for server in (router, *engines):
            server.stop()
        raise
    return prefill, decode, router


# ----- measurements -------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc: no dependency)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                # The command name may hold spaces and parentheses: the parent pid follows the last ")".
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, pending = [], [pid]
    while pending:
        for child in parents.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and all its descendants, in MiB (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        return sum(_rss_bytes(p) for p in [pid, *_children(pid)]) / (1 << 20)
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / (1 << 20)


def kv_state(url: str) -> dict[str, float]:
    """The idle-relevant series of an engine, plus the blocks it owns (usage x pool size)."""
    values = scrape(url)
    state = {name: values.get(name, 0.0) for name in IDLE_SERIES}
    pool = next((int(m.group(1)) for name in values if (m := re.search(r'num_gpu_blocks="(\d+)"', name))), 0)
    state["owned_blocks"] = round(state["pdserve_kv_cache_usage_ratio"] * pool)
    return state


def wait_idle(engines: list[Process], timeout: float) -> tuple[dict[str, dict[str, float]], float]:
    """Poll until every engine is idle (or ``timeout``); returns the last states seen and the seconds waited."""
    started = time.monotonic()
    while True:
        states = {engine.name: kv_state(engine.url) for engine in engines}
        waited = time.monotonic() - started
        if all(idle(state) for state in states.values()) or waited > timeout:
            return states, waited
        time.sleep(0.25)


def stop_cycles(process: Process, cycles: int, seconds: float, done: threading.Event) -> list[float]:
    """SIGSTOP ``process`` and its descendants ``cycles`` times for ``seconds``, then SIGCONT; the first stop
    FIRST_STOP_AFTER_S into the run, BETWEEN_STOPS_S apart; stops early once ``done`` is set. The stops' times."""
    stops: list[float] = []
    if done.wait(FIRST_STOP_AFTER_S):
        return stops
    for _ in range(cycles):
        pids = [process.process.pid, *_children(process.process.pid)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stops.append(time.monotonic())
        try:
            done.wait(seconds)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        if done.wait(BETWEEN_STOPS_S):
            break
    return stops


# ----- the workload -------------------------------------------------------------------------------------------


@dataclass
class Plan:
    index: int
    path: str
    body: dict[str, Any]
    behaviour: str  # "read": to the end; "disconnect": leave at leave_after s; "abort": close once sent
    leave_after: float = 0.0


def make_plans(count: int, seed: int, start: int = 0) -> list[Plan]:
    from pdserve.api.tokenizer import load_tokenizer
    from pdserve.models.demo import ensure_demo_model

    tokenizer = load_tokenizer(str(ensure_demo_model()))
    vocab_size = len(tokenizer)
    rng = random.Random(seed)
    plans = []
    for index in range(start, start + count):
        length = rng.choice([rng.randint(5, 30), rng.randint(30, 120), rng.randint(120, 300)])
        ids = [rng.randrange(3, vocab_size) for _ in range(length)]  # 0-2 are special tokens
        text = tokenizer.decode(ids)
        max_tokens = rng.choice([1, rng.randint(2, 16), rng.randint(16, 64), 64])
        common = {
            "model": "demo",
            "max_tokens": max_tokens,
            "stream": rng.random() < 0.5,
            "temperature": rng.choice([0.0, 0.8]),
            "ignore_eos": rng.random() < 0.7,
        }
        if common["stream"] and rng.random() < 0.5:
            common["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            path, body = "/v1/completions", {"prompt": ids if rng.random() < 0.5 else text, **common}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **common}
        draw = rng.random()
        behaviour = "read" if draw < 0.6 else "disconnect" if draw < 0.9 else "abort"
        # A moment within the typical life of a request here (~0.1-1 s: queueing, prefill leg, transfer, decode).
        plans.append(Plan(index, path, body, behaviour, leave_after=rng.uniform(0.0, 0.5)))
    return plans


@dataclass
class Outcomes:
    completed: int = 0
    disconnected: int = 0  # left before the end, as planned
    aborted: int = 0  # closed right after sending
    errors: Counter = field(default_factory=Counter)
    samples: dict[str, str] = field(default_factory=dict)  # one example per error kind

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.samples.setdefault(kind, detail[:300])


async def _read(session: aiohttp.ClientSession, url: str, plan: Plan) -> tuple[str, str]:
    """Send the request and read the answer to its end: ("completed", "") or (error kind, detail)."""
    async with session.post(url + plan.path, json=plan.body) as response:
        payload = await response.read()
        if response.status != 200:
            return f"http_{response.status}", payload.decode(errors="replace")
        if not plan.body["stream"]:
            answer = json.loads(payload)
            return ("completed", "") if answer.get("choices") else ("bad_answer", payload.decode()[:300])
        events = [event for event in payload.decode(errors="replace").split("\n\n") if event.strip()]
        if any('"error"' in event for event in events):
            return "stream_error_event", next(event for event in events if '"error"' in event)
        if not events or events[-1] != "data: [DONE]":
            return "stream_incomplete", events[-1] if events else "(empty)"
        return "completed", ""


async def _abort(url: str, plan: Plan) -> None:
    """Write the whole request, then close the connection without reading a byte."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(plan.body).encode()
    head = (
        f"POST {plan.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def run_plans(url: str, plans: list[Plan], outcomes: Outcomes) -> None:
    queue: asyncio.Queue[Plan] = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(plan)
    # force_close: a connection per request, so leaving one never disturbs another client's keep-alive connection.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while not queue.empty():
                plan = queue.get_nowait()
                try:
                    if plan.behaviour == "abort":
                        await _abort(url, plan)
                        outcomes.aborted += 1
                        continue
                    limit = plan.leave_after if plan.behaviour == "disconnect" else None
                    kind, detail = await asyncio.wait_for(_read(session, url, plan), limit)
                except TimeoutError:
                    if plan.behaviour == "disconnect":
                        outcomes.disconnected += 1  # wait_for cancelled the read: the connection is closed
                    else:
                        outcomes.error("timeout", f"request {plan.index}")
                    continue
                except (aiohttp.ClientError, OSError, ValueError) as error:
                    outcomes.error(f"client_{type(error).__name__}", f"request {plan.index}: {error}")
                    continue
                if kind == "completed":
                    outcomes.completed += 1
                else:
                    outcomes.error(kind, f"request {plan.index} {plan.path} {json.dumps(plan.body)[:120]}: {detail}")

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


# ----- the run ------------------------------------------------------------------------------------------------


def router_counts(url: str) -> tuple[dict[str, float], dict[str, float]]:
    values = scrape(url)
    paths = {
        m.group(1): v
        for name, v in values.items()
        if (m := re.fullmatch(r'pdserve_router_requests_total\{path="(\w+)"\}', name))
    }
    errors = {
        m.group(1): v
        for name, v in values.items()
        if (m := re.fullmatch(r'pdserve_router_errors_total\{kind="(\w+)"\}', name)) and v
    }
    return paths, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", choices=["nixl", "tcp"], default="nixl")
    parser.add_argument(
        "--rss-bound-mib",
        type=float,
        default=64.0,
        help="largest RSS growth allowed per process (engine: API + core) after the warm-up",
    )
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder, kept on failure)")
    parser.add_argument(
        "--stop-cycles", type=int, default=0, help="SIGSTOP/SIGCONT the prefill engine this many times during the run"
    )
    parser.add_argument("--stop-seconds", type=float, default=3.0, help="how long each stop lasts")
    args = parser.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    warmup_count = max(1, args.requests // 10)
    plans = make_plans(args.requests, args.seed)
    prefill, decode, router = start_cluster(log_dir, args.transport)
    servers, engines = [prefill, decode, router], [prefill, decode]
    outcomes = Outcomes()
    try:
        print(f"cluster up in {time.monotonic() - started:.1f} s ({args.transport}); logs in {log_dir}", flush=True)
        run_started = time.monotonic()
        asyncio.run(run_plans(router.url, plans[:warmup_count], outcomes))
        wait_idle(engines, LEASE_SECONDS + 10)
        rss_warm = {server.name: tree_rss_mib(server.process.pid) for server in servers}
        run_ended = threading.Event()
        stops: list[float] = []
        stopper = threading.Thread(
            target=lambda: stops.extend(stop_cycles(prefill, args.stop_cycles, args.stop_seconds, run_ended))
        )
        if args.stop_cycles:
            stopper.start()
        try:
            asyncio.run(run_plans(router.url, plans[warmup_count:], outcomes))
        finally:
            run_ended.set()
            if args.stop_cycles:
                stopper.join()
        run_seconds = time.monotonic() - run_started
        final, idle_after = wait_idle(engines, LEASE_SECONDS + 10)
        expirations = scrape(prefill.url).get("pdserve_kv_lease_expirations_total", 0)
        rss_end = {server.name: tree_rss_mib(server.process.pid) for server in servers}
        paths, router_errors = router_counts(router.url)
        alive = {server.name: server.process.poll() is None and server.healthy() for server in servers}
    finally:
        for server in servers:
            server.stop()

    growth = {name: rss_end[name] - rss_warm[name] for name in rss_warm}
    # A request timeout is a failure here too: the soak bounds every request well below it.
    failed_kinds = (*ROUTER_LEG_FAILURES, "timeout")
    if args.stop_cycles:
        failed_kinds = tuple(kind for kind in failed_kinds if kind not in STOPPED_PREFILL_FAILURES)
    leg_failures = {kind: count for kind, count in router_errors.items() if kind in failed_kinds}
    leftover_blocks = int(
        sum(max(state["owned_blocks"], state["pdserve_kv_blocks_held_for_remote"]) for state in final.values())
    )
    leaked = not all(idle(state) for state in final.values())
    errors = sum(outcomes.errors.values())
    ok = (
        all(alive.values())
        and errors == 0
        and not leg_failures
        and not leaked
        and max(growth.values()) <= args.rss_bound_mib
    )

    print(
        f"{args.requests} requests ({warmup_count} warm-up), concurrency {CONCURRENCY}, "
        f"{run_seconds:.1f} s of traffic, {time.monotonic() - started:.1f} s in all"
    )
    print(
        f"  completed {outcomes.completed}, disconnected {outcomes.disconnected}, aborted {outcomes.aborted}, "
        f"errors {errors}"
    )
    for kind, count in outcomes.errors.most_common():
        print(f"    {kind}: {count}  e.g. {outcomes.samples[kind]}")
    print(f"  router paths {paths}; router errors {router_errors}")
    if args.stop_cycles:
        print(f"  prefill stopped {len(stops)} times for {args.stop_seconds:g} s")
    for name in rss_warm:
        print(
            f"  RSS {name:<8} warm-up {rss_warm[name]:7.1f} MiB  end {rss_end[name]:7.1f} MiB  "
            f"growth {growth[name]:+6.1f} MiB (bound {args.rss_bound_mib:g})"
        )
    # Holds whose decode leg never came (the client left between the legs) end by lease expiry, not by release.
    print(f"  idle {idle_after:.1f} s after the last request; prefill lease expirations {expirations:g}")
    for name, state in final.items():
        print(
            f"  {name} at the end: "
            + ", ".join(f"{key.removeprefix('pdserve_')}={value:g}" for key, value in state.items())
        )
    print(f"  alive and healthy: {alive}")
    if not ok:
        print(f"  NOT OK; server logs kept in {log_dir}")
    elif args.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "soak",
                "requests": args.requests,
                "completed": outcomes.completed,
                "left": outcomes.disconnected + outcomes.aborted,
                "errors": errors,
                "rss_growth_mib": round(max(growth.values()), 1),
                "prefill_stops": len(stops),
                "leftover_blocks": leftover_blocks,
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
