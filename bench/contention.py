"""pdserve's CPU engine beside busy processes: output tokens/s with 0, 1 and 2 competing single-threaded spin
loops, at batch 1 and batch 64, for three thread settings, each in a fresh process (OpenMP reads its settings
once), alternating, the median of ``--rounds``. About 15 minutes on 2 cores with the defaults.

Settings:
- ``fixed, spinning``: as many threads as CPUs, ``GOMP_SPINCOUNT=100000`` (pdserve's default spin), no
  adaptation: the engine before ``ThreadGovernor``;
- ``fixed, passive``: the same with ``GOMP_SPINCOUNT=0`` (threads sleep at once at a barrier);
- ``governed``: threads from the CPU budget, and fewer while others take the CPUs (pdserve as shipped).

Model: the bench model of bench/throughput.py (~110M Llama, fp32, seeded); 128-token random prompts, greedy,
EOS ignored; batch 64 generates ``--new-tokens-64`` tokens each, batch 1 ``--new-tokens-1``. The load
average is printed before each measurement. Then, where this process may make cgroups (root, cgroup v1 ``cpu``),
a real CPU quota of ``--quota`` CPUs (1.0) under every CPU of affinity, as a pod's ``limits.cpu`` on a bigger
node: as many threads as CPUs (the engine before it read its quota) against the budget's, no spinners.
Last line: {"bench": "contention", "rows": [...]} (tok/s per setting, spinners and batch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SETTINGS = {
    "fixed, spinning": {"GOMP_SPINCOUNT": "100000", "THREADS": "cpus"},
    "fixed, passive": {"GOMP_SPINCOUNT": "0", "THREADS": "cpus"},
    "governed": {"GOMP_SPINCOUNT": "100000"},
}


def measure(folder: str, spinners: int, batch: int, new_tokens: int) -> float:
    """One run in this process: tok/s of one generate with ``spinners`` busy processes beside it."""
    from throughput import tokens_per_second

    import pdserve  # noqa: F401  (before torch: pdserve.OPENMP_ENV)
    from pdserve import LLM
    from pdserve.models.demo import ensure_demo_model

    random.seed(0)
    prompts = [[random.randrange(100, 30000) for _ in range(128)] for _ in range(batch)]
    llm = LLM(folder, tokenizer=str(ensure_demo_model()), max_model_len=512, kv_cache_memory=1 << 30)
    with spinning(spinners):
        return tokens_per_second(llm, prompts, new_tokens)


@contextmanager
def spinning(count: int) -> Iterator[None]:
    """``count`` single-threaded busy processes, running half a second before the body and killed after it."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


def run_one(
    folder: str, setting: str, spinners: int, batch: int, new_tokens: int, enter: Callable[[], None] | None = None
) -> float:
    """tok/s of one fresh process with ``setting``'s environment (``enter``: run in the child first, to join a
    cgroup)."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT=SETTINGS[setting]["GOMP_SPINCOUNT"])
    env.pop("OMP_NUM_THREADS", None)
    if SETTINGS[setting].get("THREADS") == "cpus":
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))  # given: no governor
    argv = [sys.executable, __file__, "--one", folder, str(spinners), str(batch), str(new_tokens)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, preexec_fn=enter)
    return float(done.stdout.strip().splitlines()[-1])


def quota_rows(folder: str, quota: float, rounds: int, new_tokens: dict[int, int]) -> list[dict]:
    """A real cgroup CPU quota of ``quota`` CPUs under every CPU of affinity (a pod's ``limits.cpu`` on a bigger
    node): as many threads as CPUs (the engine before it read its quota), and the budget's (``governed``: the
    quota, rounded down), no spinners."""
    from pdserve.testing.cgroups import Unavailable, limited

    results: dict[tuple[str, int], list[float]] = {}
    try:
        with limited(cpus=quota) as cgroup:
            for _ in range(rounds):
                for batch, tokens in new_tokens.items():
                    for setting in ("fixed, spinning", "governed"):
                        tok_s = run_one(folder, setting, 0, batch, tokens, cgroup.enter)
                        results.setdefault((setting, batch), []).append(tok_s)
                        print(f"quota {quota:g} CPUs  {setting:<16} batch {batch:>2}: {tok_s:7.1f} tok/s", flush=True)
    except Unavailable as why:
        print(f"no CPU-quota rows: {why}")
        return []
    rows = []
    print(f"\nin a cgroup of {quota:g} CPUs (of {len(os.sched_getaffinity(0))}), median of {rounds} rounds, tok/s")
    for setting in ("fixed, spinning", "governed"):
        row = {"setting": setting, "quota": quota}
        for batch in new_tokens:
            row[f"batch{batch}"] = round(statistics.median(results[setting, batch]), 1)
        rows.append(row)
        print(f"{setting:<18}{row['batch1']:>16}{row['batch64']:>18}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spinners", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--new-tokens-64", type=int, default=32)
    parser.add_argument("--new-tokens-1", type=int, default=64)
    parser.add_argument("--quota", type=float, default=1.0, help="CPUs of the cgroup-quota rows (0: none)")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        folder, spinners, batch, new_tokens = args.one
        print(measure(folder, int(spinners), int(batch), int(new_tokens)))
        return
    from throughput import build_model

    with tempfile.TemporaryDirectory(prefix="pdserve-contention-") as folder:
        build_model(folder)
        results: dict[tuple[str, int, int], list[float]] = {}
        for _ in range(args.rounds):
            for spinners in args.spinners:
                for batch, new_tokens in ((1, args.new_tokens_1), (64, args.new_tokens_64)):
                    for setting in SETTINGS:
                        load = os.getloadavg()[0]
                        tok_s = run_one(folder, setting, spinners, batch, new_tokens)
                        results.setdefault((setting, spinners, batch), []).append(tok_s)
                        where = f"{setting:<16} spinners {spinners} batch {batch:>2}"
                        print(f"load {load:4.2f}  {where}: {tok_s:7.1f} tok/s", flush=True)
        tokens_per_batch = {1: args.new_tokens_1, 64: args.new_tokens_64}
        quota = quota_rows(folder, args.quota, args.rounds, tokens_per_batch) if args.quota else []
    rows = []
    print(f"\nmedian of {args.rounds} rounds, output tok/s (share of the same setting's quiet figure)")
    print(f"{'setting':<18}{'spinners':>9}{'batch 1':>16}{'batch 64':>18}")
    for setting in SETTINGS:
        for spinners in args.spinners:
            cells = []
            row = {"setting": setting, "spinners": spinners}
            for batch in (1, 64):
                value = statistics.median(results[setting, spinners, batch])
                quiet = statistics.median(results[setting, args.spinners[0], batch])
                row[f"batch{batch}"] = round(value, 1)
                cells.append(f"{value:8.1f} ({value / quiet:4.0%})")
            rows.append(row)
            print(f"{setting:<18}{spinners:>9}{cells[0]:>16}{cells[1]:>18}")
    print(json.dumps({"bench": "contention", "rows": rows, "quota_rows": quota}))


if __name__ == "__main__":
    main()
