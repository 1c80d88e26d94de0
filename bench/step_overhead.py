"""A decode step's time outside the model, and generation throughput, of this tree against another commit's,
in one command: ``--compare REF`` checks REF out in a git worktree and runs the same measurement on it, the
two trees alternating for ``--rounds`` rounds (medians reported, and this tree's over REF's).

Model: ``throughput.py``'s ~110M Llama (fp32, random seeded weights), in this process's executor (``uni``).
Per tree and round, in a fresh process: output tok/s of ``LLM.generate`` at batch 64 (128-token prompts,
128 new tokens) and batch 1 (the same, one prompt); and over the decode steps of those runs, per step, the
runner's ``execute_model`` wall time split into the model's forward pass, the LM head (``compute_logits``)
and the rest: preparing the inputs, sampling and bookkeeping (the step's non-kernel time).

Last line: {"bench": "step_overhead", ...}. About 2 minutes a round on 2 cores.
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
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def measure(model_folder: str) -> dict[str, float]:
    """One tree's figures (run in a process of its own, with that tree first on the path)."""
    import pdserve  # noqa: F401  (before torch loads: how its OpenMP threads wait)

    # isort: split
    from throughput import MODEL

    from pdserve import LLM, SamplingParams
    from pdserve.models.demo import ensure_demo_model

    llm = LLM(model_folder, tokenizer=str(ensure_demo_model()), max_model_len=512, kv_cache_memory=2 << 30)
    runner = llm.engine.model_executor
    clock = {"forward": 0.0, "logits": 0.0}
    steps: list[tuple[int, float, float, float]] = []  # (batch, execute, forward, logits)

    def timed(name, function):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            clock[name] += time.perf_counter() - start
            return result

        return run

    runner.model.forward = timed("forward", runner.model.forward)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    execute = runner.execute_model

    def timed_execute(scheduler_output):
        clock["forward"] = clock["logits"] = 0.0
        start = time.perf_counter()
        output = execute(scheduler_output)
        decodes = all(n == 1 for n in scheduler_output.num_scheduled_tokens)
        if decodes and scheduler_output.requests:
            steps.append(
                (len(scheduler_output.requests), time.perf_counter() - start, clock["forward"], clock["logits"])
            )
        return output

    runner.execute_model = timed_execute
    rng = random.Random(0)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(128)] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    figures: dict[str, float] = {}
    for batch in (64, 1):
        steps.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts[:batch], params)
        elapsed = time.perf_counter() - start
        figures[f"batch_{batch}_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
        full = [step for step in steps if step[0] == batch]
        figures[f"batch_{batch}_step_ms"] = statistics.median(s[1] for s in full) * 1e3
        figures[f"batch_{batch}_forward_ms"] = statistics.median(s[2] for s in full) * 1e3
        figures[f"batch_{batch}_logits_ms"] = statistics.median(s[3] for s in full) * 1e3
        figures[f"batch_{batch}_rest_us"] = statistics.median(s[1] - s[2] - s[3] for s in full) * 1e6
    return figures


def run_tree(tree: Path, model_folder: str) -> dict[str, float]:
    environment = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{BENCH}", "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, str(BENCH / "step_overhead.py"), "--measure", model_folder],
        env=environment,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", metavar="REF", help="the commit to measure against (a git worktree of it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", metavar="MODEL", help=argparse.SUPPRESS)  # one tree's run (internal)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    from throughput import build_model

    with tempfile.TemporaryDirectory() as scratch:
        model_folder = str(Path(scratch) / "model")
        build_model(model_folder)
        trees = {"this tree": ROOT}
        if args.compare:
            worktree = Path(scratch) / "baseline"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.compare], check=True
            )
            trees[args.compare] = worktree
        try:
            results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            for round_index in range(args.rounds):
                order = list(trees) if round_index % 2 == 0 else list(trees)[::-1]
                for name in order:
                    figures = run_tree(trees[name], model_folder)
                    results[name].append(figures)
                    print(
                        f"round {round_index + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()),
                        flush=True,
                    )
        finally:
            if args.compare:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
        medians = {
            name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in results.items()
        }
        for name, row in medians.items():
            print(f"median {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        if args.compare:
            ours, theirs = medians["this tree"], medians[args.compare]
            ratios = {key: ours[key] / theirs[key] for key in ours}
            print("this tree / " + args.compare + ": " + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items()))
        print(json.dumps({"bench": "step_overhead", "medians": medians}))


if __name__ == "__main__":
    main()
