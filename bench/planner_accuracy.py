"""The planner's predictions against measured runs: TTFT and TPOT p50/p90, colocated and 1P1D,
short and long prompts, on this machine.

Model and setups as bench/pd_vs_colocated.py (a ~85M Llama, fp32; colocated: one engine on both
cores with 2 threads; 1P1D: prefill pinned to core 0, decode to core 1, one thread each, router
unpinned, KV over NIXL). Each setup is profiled as it runs (`pdserve profile` pinned the same way,
the same engine flags), then loaded with `pdserve bench`'s generator; the planner's simulator
replays exactly the arrivals the generator sent (times, prompt and output lengths) through the
profiled engines. Workloads: short prompts (128 in, 64 out) and long prompts (512 in, 64 out).

Prints the table (predicted, measured, error) and, with --plot DIR, writes
DIR/planner_accuracy.png. About 15 minutes on 2 cores. Last line: JSON with the largest error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pd_vs_colocated import ENGINE_FLAGS, build_model, run_setup
from plots import add_plot_argument, pyplot, save

from pdserve.bench.loadgen import BenchConfig, arrival_offsets, make_workload
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import Deployment, simulate
from pdserve.planner.workload import Arrival
from pdserve.testing.processes import server_env

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

WORKLOADS = {"short": (128, 64), "long": (512, 64)}
# Setups: how its engines run (taskset cores, torch threads) and the deployment simulated.
SETUPS = {"colocated": ("0,1", 2, Deployment(colocated=1)), "1P1D": ("0", 1, Deployment(prefill=1, decode=1))}
METRICS = (("ttft", "median"), ("ttft", "p90"), ("tpot", "median"), ("tpot", "p90"))


def profile(folder: Path, cores: str, threads: int, out: Path) -> Profile:
    """`pdserve profile` of the bench model, pinned and threaded as the setup's engines run."""
    flags = list(ENGINE_FLAGS)
    for flag in ("--served-model-name", "--log-level"):  # server flags, not the engine's
        index = flags.index(flag)
        del flags[index : index + 2]
    command = ["taskset", "-c", cores, sys.executable, "-m", "pdserve.cli", "profile", "--model", str(folder)]
    command += [*flags, "--max-batch", "32", "-o", str(out)]
    run = subprocess.run(command, env=server_env(threads), capture_output=True, text=True, timeout=1800)
    if run.returncode:
        raise RuntimeError(f"pdserve profile failed:\n{run.stderr[-3000:]}")
    print(run.stdout.strip().splitlines()[-1])
    return Profile.load(out)


def replayed(args: argparse.Namespace) -> list[Arrival]:
    """Exactly the requests pdserve bench sends (run_load's config): times, prompt and output lengths."""
    config = BenchConfig(
        base_url="",
        model="bench",
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        ignore_eos=True,
        seed=1,
    )
    requests = make_workload(config)
    offsets = arrival_offsets(len(requests), config.request_rate, config.arrival, config.seed)
    return [
        Arrival(offset, list(request.prompt_token_ids or []), request.output_len)
        for request, offset in zip(requests, offsets, strict=True)
    ]


def predicted(deployment: Deployment, arrivals: list[Arrival], engine: Profile) -> dict[str, float]:
    result = simulate(deployment, arrivals, engine)
    return {
        f"{stat}_{metric}_ms": result.percentile(metric, 0.5 if stat == "median" else 0.9) * 1000
        for metric, stat in METRICS
    }


def plot(rows: list[dict], folder: Path) -> None:
    figure, axes = pyplot().subplots(1, 2, figsize=(10, 4.5))
    for axis, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for row in rows:
            for stat, marker in (("median", "o"), ("p90", "^")):
                key = f"{stat}_{metric}_ms"
                axis.scatter(row["measured"][key], row["predicted"][key], marker=marker, label=f"{row['name']} {stat}")
        top = max(max(r["measured"][f"p90_{metric}_ms"], r["predicted"][f"p90_{metric}_ms"]) for r in rows) * 1.1
        axis.plot([0, top], [0, top], color="grey", linewidth=0.8)
        axis.plot([0, top], [0, top * 1.2], color="grey", linewidth=0.5, linestyle="--")
        axis.plot([0, top], [0, top * 0.8], color="grey", linewidth=0.5, linestyle="--")
        axis.set_xlabel(f"measured {metric.upper()} (ms)")
        axis.set_ylabel(f"predicted {metric.upper()} (ms)")
        axis.legend(fontsize=6)
    figure.suptitle("planner: predicted vs measured, 2 cores (bench/planner_accuracy.py); dashed: ±20%")
    save(figure, folder, "planner_accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--request-rate", type=float, default=0.7)
    add_plot_argument(parser)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        build_model(folder)
        for setup, (cores, threads, deployment) in SETUPS.items():
            engine = profile(folder, cores, threads, Path(scratch) / f"{setup}.json")
            for workload, (input_len, output_len) in WORKLOADS.items():
                run = argparse.Namespace(
                    num_prompts=args.num_prompts,
                    request_rate=args.request_rate,
                    input_len=input_len,
                    output_len=output_len,
                    slo_ttft_ms=None,
                    slo_tpot_ms=None,
                )
                measured = run_setup(setup, folder, Path(scratch), run)
                guess = predicted(deployment, replayed(run), engine)
                rows.append(
                    {
                        "name": f"{setup} {workload}",
                        "measured": {f"{s}_{m}_ms": measured[f"{s}_{m}_ms"] for m, s in METRICS},
                        "predicted": guess,
                        "failed": measured["failed"],
                    }
                )
    print(f"{args.num_prompts} requests a run, Poisson {args.request_rate}/s; predicted / measured ms (error)")
    print(f"{'run':<16}" + "".join(f"{f'{m} {s}':>26}" for m, s in METRICS))
    worst = 0.0
    for row in rows:
        cells = []
        for metric, stat in METRICS:
            key = f"{stat}_{metric}_ms"
            guess, real = row["predicted"][key], row["measured"][key]
            error = (guess - real) / real if real else 0.0
            worst = max(worst, abs(error))
            cells.append(f"{guess:9.0f} / {real:6.0f} ({error:+5.0%})")
        print(f"{row['name']:<16}" + "".join(f"{cell:>26}" for cell in cells))
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"bench": "planner_accuracy", "worst_error": round(worst, 3), "rows": rows}))


if __name__ == "__main__":
    main()
