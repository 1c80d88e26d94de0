"""Scheduler step cost: schedule() + update_from_output() per step, model excluded.

Workload (issue #2): block size 16, prefix caching on, unique 128-token prompts, ignore EOS.
Steady: N requests brought to steady decode (nothing arriving, nothing finishing).
Churn: the same N long decodes plus 2 new 128-token prompts arriving every step, each finishing
after 8 output tokens (so about 2 prefills, 16 short decodes and 2 finishes per step on top).
After warm-up, 200 steps are timed; the median per step is reported. The deterministic fake
runner supplies tokens and is not timed. Runs in about a minute on 2 cores. With --plot DIR, writes
DIR/scheduler.png.

Last line: {"bench": "scheduler", "running": 256, "step_ms": X} for the 256-request steady case.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from plots import add_plot_argument, bar_chart

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_config import SchedulerConfig
from pdserve.testing.fake_runner import FakeModelRunner

BLOCK_SIZE = 16
PROMPT_LEN = 128
VOCAB = 32000


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]


def run_case(num_running: int, churn: bool, warmup: int, steps: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    total_steps = warmup + steps + 8
    blocks_per_long = -(-(PROMPT_LEN + total_steps + 64) // BLOCK_SIZE)
    num_blocks = num_running * blocks_per_long + (64 * 10 if churn else 0)
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=4096,
        max_num_seqs=num_running + 64,
        max_num_batched_tokens=8192,
        enable_prefix_caching=True,
    )
    scheduler = Scheduler(config)
    runner = FakeModelRunner(num_blocks, BLOCK_SIZE, VOCAB)
    long_params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    short_params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i in range(num_running):
        scheduler.add_request(Request(f"long-{i}", _prompt(rng), long_params))

    def step() -> tuple[int, int]:
        """(schedule ns, update ns) of one step."""
        start = time.perf_counter_ns()
        scheduler_output = scheduler.schedule()
        mid = time.perf_counter_ns()
        runner_output = runner.execute_model(scheduler_output)
        resume = time.perf_counter_ns()
        scheduler.update_from_output(scheduler_output, runner_output)
        return mid - start, time.perf_counter_ns() - resume

    # Bring every long request through its prefill into steady decode.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        step()
    arrivals = 0
    durations, schedule_parts, update_parts = [], [], []
    for index in range(warmup + steps):
        if churn:
            for _ in range(2):
                scheduler.add_request(Request(f"short-{arrivals}", _prompt(rng), short_params))
                arrivals += 1
        schedule_ns, update_ns = step()
        if index >= warmup:
            durations.append(schedule_ns + update_ns)
            schedule_parts.append(schedule_ns)
            update_parts.append(update_ns)
    assert scheduler.num_preemptions == 0, "the benchmark must not preempt"
    return {
        "running": num_running,
        "churn": churn,
        "median_ms": statistics.median(durations) / 1e6,
        "p90_ms": sorted(durations)[int(0.9 * len(durations))] / 1e6,
        "schedule_ms": statistics.median(schedule_parts) / 1e6,
        "update_ms": statistics.median(update_parts) / 1e6,
        "num_running_end": len(scheduler.running),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    add_plot_argument(parser)
    args = parser.parse_args()
    results = {}
    print(
        f"{'running':>8} {'variant':>8} {'median ms/step':>15} {'p90 ms/step':>12} {'us/request':>11} "
        f"{'schedule ms':>12} {'update ms':>10}"
    )
    for churn in (False, True):
        for size in args.sizes:
            result = run_case(size, churn, args.warmup, args.steps)
            results[(size, churn)] = result
            variant = "churn" if churn else "steady"
            print(
                f"{size:>8} {variant:>8} {result['median_ms']:>15.3f} {result['p90_ms']:>12.3f} "
                f"{1000 * result['median_ms'] / size:>11.2f} {result['schedule_ms']:>12.3f} "
                f"{result['update_ms']:>10.3f}",
                flush=True,
            )
    if args.plot:
        bar_chart(
            args.plot,
            "scheduler",
            "scheduler step (schedule + update from output), model excluded",
            "ms per step",
            {
                f"{size} running": {
                    variant: results[(size, churn)]["median_ms"]
                    for churn, variant in ((False, "steady"), (True, "churn"))
                }
                for size in args.sizes
            },
        )
    key = (256, False) if (256, False) in results else next(iter(results))
    print(json.dumps({"bench": "scheduler", "running": key[0], "step_ms": round(results[key]["median_ms"], 4)}))


if __name__ == "__main__":
    main()
