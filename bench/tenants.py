"""Flow control between tenants against a real engine: a light tenant's TTFT while another floods, with and without
flow control, and a high-priority band's TTFT while the fleet is saturated. About 3 minutes on 2 cores.

Setup: one `pdserve decode` engine on the demo model (pinned to core 0, 1 thread, ``--max-num-seqs`` 8: its
saturation point here, priority scheduling) behind two routers on core 1, started with the same tenant table: one
with flow control (``--saturation-queue 2``), one without (``--no-flow-control``, the baseline). Tenant A may have
16 requests waiting in the router; B is a light, steady tenant whose range allows priority -1.

First the engine's capacity C (requests/s, closed loop at concurrency 8). Then, each for --seconds:
1. ``alone``: B alone at --light-rate requests/s (Poisson), through the flow-controlled router;
2. ``flood``: the same B, with A open-loop at 5x its half of C, through the flow-controlled router;
3. ``flood_no_fc``: the same through the router without flow control;
4. ``priority``: the flood again, B sending priority -1.
Requests: a ~60-token prompt, 16 output tokens, streamed; TTFT is the first content event's arrival. Reported:
B's TTFT p50/p90 per phase and their ratio to ``alone``, A's answered/429 counts, its answered rate (over the
phase until its last answer) and the seconds its backlog took to drain after sending stopped, and what
Retry-After said. ``--engine-args`` adds engine flags (e.g. ``'--max-num-batched-tokens 72'``: shorter steps, so a
light tenant's prompt waits less behind a step of the flood's). Last line JSON {"bench": "tenants", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from pd_vs_colocated import free_port, start

from pdserve.models.demo import ensure_demo_model
from pdserve.testing.processes import cpu_engine_flags, router_argv

TABLE = {
    "tenants": {
        "A": {"keys": ["sk-a"], "max_queued": 16},
        "B": {"keys": ["sk-b"], "priority": {"default": 0, "min": -1, "max": 0}},
    }
}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "pale", "wizards"]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(60))


async def _one(session: aiohttp.ClientSession, url: str, key: str, rng: random.Random, priority: int | None) -> dict:
    body = {"model": "demo", "prompt": _prompt(rng), "max_tokens": 16, "stream": True, "ignore_eos": True}
    if priority is not None:
        body["priority"] = priority
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
        if response.status != 200:
            await response.read()
            return {"status": response.status, "retry_after": response.headers.get("Retry-After")}
        ttft = None
        async for line in response.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - started
        return {"status": 200, "ttft": ttft, "latency": time.perf_counter() - started}


async def _open_loop(url: str, key: str, rate: float, seconds: float, seed: int, priority: int | None) -> list[dict]:
    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            tasks.append(asyncio.create_task(_one(session, url, key, rng, priority)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


async def _capacity(url: str, seconds: float) -> float:
    rng = random.Random(1)
    done = 0
    async with aiohttp.ClientSession() as session:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                if (await _one(session, url, "sk-a", rng, None))["status"] == 200:
                    done += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(8)))
        return done / (time.perf_counter() - started)


def _ttfts(results: list[dict]) -> dict:
    ttfts = sorted(r["ttft"] for r in results if r["status"] == 200 and r["ttft"] is not None)
    if not ttfts:
        return {"answered": 0}
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    return {"answered": len(ttfts), "ttft_p50_ms": statistics.median(ttfts) * 1e3, "ttft_p90_ms": p90 * 1e3}


async def _phase(url: str, args: argparse.Namespace, flood_rate: float | None, priority: int | None) -> dict:
    light = _open_loop(url, "sk-b", args.light_rate, args.seconds, 11, priority)
    if flood_rate is None:
        return {"B": _ttfts(await light)}
    flood = _open_loop(url, "sk-a", flood_rate, args.seconds, 12, None)
    started = time.perf_counter()
    b_results, a_results = await asyncio.gather(light, flood)
    elapsed = time.perf_counter() - started  # until the last answer: a backlog drains after the sending stops
    refused = [r for r in a_results if r["status"] == 429]
    return {
        "B": _ttfts(b_results),
        "A": {
            **_ttfts(a_results),
            "sent": len(a_results),
            "refused_429": len(refused),
            "other_errors": sum(1 for r in a_results if r["status"] not in (200, 429)),
            "answered_per_s": sum(1 for r in a_results if r["status"] == 200) / elapsed,
            "drain_s": elapsed - args.seconds,
            "retry_after": sorted({r["retry_after"] for r in refused}),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--light-rate", type=float, default=1.0, help="tenant B's requests/s")
    parser.add_argument(
        "--engine-args", default="", help="more flags for the engine, one string (e.g. '--max-num-batched-tokens 72')"
    )
    args = parser.parse_args()
    model = str(ensure_demo_model())
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        table = scratch / "tenants.json"
        table.write_text(json.dumps(TABLE))
        processes = []
        try:
            port = free_port()
            flags = [*cpu_engine_flags("64MiB"), "--max-num-seqs", "8", "--scheduling-policy", "priority"]
            flags += args.engine_args.split()
            engine = start("engine", port, ["decode", "--port", str(port), "--model", model, *flags], scratch, "0")
            processes.append(engine)
            engine.wait_healthy(300)
            routers = {}
            for name, extra in (("fc", ["--saturation-queue", "2"]), ("no_fc", ["--no-flow-control"])):
                port = free_port()
                argv = router_argv(port, [], [engine.url], "--tenants", str(table), "--routing", "least-load", *extra)
                routers[name] = start(f"router-{name}", port, argv, scratch, "1")
                processes.append(routers[name])
            for router in routers.values():
                router.wait_healthy(120)
            capacity = asyncio.run(_capacity(routers["no_fc"].url, 10.0))
            flood_rate = 5 * capacity / 2
            print(f"capacity {capacity:.1f} req/s; A floods at {flood_rate:.1f} req/s, B sends {args.light_rate} req/s")
            phases = {
                "alone": asyncio.run(_phase(routers["fc"].url, args, None, None)),
                "flood": asyncio.run(_phase(routers["fc"].url, args, flood_rate, None)),
                "flood_no_fc": asyncio.run(_phase(routers["no_fc"].url, args, flood_rate, None)),
                "priority": asyncio.run(_phase(routers["fc"].url, args, flood_rate, -1)),
            }
        finally:
            for process in processes:
                process.stop()
    alone = phases["alone"]["B"]
    print(f"{'phase':<12} {'B p50 ms':>9} {'B p90 ms':>9} {'p90/alone':>9} {'A ok/s':>7} {'A 429':>6} {'A sent':>7}")
    summary = {"bench": "tenants", "capacity_rps": round(capacity, 2), "flood_rps": round(flood_rate, 2)}
    for name, phase in phases.items():
        b = phase["B"]
        ratio = b.get("ttft_p90_ms", float("nan")) / alone["ttft_p90_ms"]
        a = phase.get("A", {})
        print(
            f"{name:<12} {b.get('ttft_p50_ms', float('nan')):9.1f} {b.get('ttft_p90_ms', float('nan')):9.1f} "
            f"{ratio:9.2f} {a.get('answered_per_s', 0):7.2f} {a.get('refused_429', 0):6d} {a.get('sent', 0):7d}"
        )
        summary[f"b_ttft_p90_ms_{name}"] = round(b.get("ttft_p90_ms", float("nan")), 1)
        summary[f"b_p90_ratio_{name}"] = round(ratio, 2)
        if a:
            summary[f"a_answered_per_s_{name}"] = round(a["answered_per_s"], 2)
            summary[f"drain_s_{name}"] = round(a["drain_s"], 1)
            summary[f"a_429_{name}"] = a["refused_429"]
            summary[f"a_other_errors_{name}"] = a["other_errors"]
            summary[f"retry_after_{name}"] = a["retry_after"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
