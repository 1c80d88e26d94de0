"""Sampling step cost with and without seeds: ``Sampler.sample`` at batch 64 x vocab 32000, temperature 0.8,
every row seeded vs none (issue #35: a stream is continued on another engine drawing the same tokens only when
its draws come from a seed, so the engine gives a seed to every sampled stream the router relays).

Each case: 3 warm-up steps, then 25 timed steps (median), repeated 3 times alternating the two cases (the minimum
of the medians is reported); with top-p 1.0 (no filter) and 0.95 (a sort over the vocabulary). Takes about a
minute on 2 cores.

Last line: {"bench": "sampler", "seeded_over_unseeded": R} at top-p 0.95.
"""

from __future__ import annotations

import argparse
import json
import time

import pdserve  # noqa: F401  (before torch loads: how its OpenMP threads wait, pdserve.OPENMP_ENV)

# isort: split
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.worker.sampler import Sampler

BATCH = 64
VOCAB = 32000


def step_ms(sampler: Sampler, logits: torch.Tensor, seeded: bool, top_p: float, steps: int) -> float:
    """The median milliseconds of one sampling step over ``steps`` steps."""
    requests = [
        Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.8, top_p=top_p, seed=i if seeded else None))
        for i in range(BATCH)
    ]
    for _ in range(3):
        sampler.sample(logits.clone(), requests)
    times = []
    for step in range(steps):
        for request in requests:
            request.append_output_token(step % 100)  # a new output position each step, as decoding goes
        started = time.perf_counter()
        sampler.sample(logits.clone(), requests)
        times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0))
    ratio = 0.0
    for top_p in (1.0, 0.95):
        unseeded, seeded = [], []
        for _ in range(args.repeats):
            unseeded.append(step_ms(sampler, logits, False, top_p, args.steps))
            seeded.append(step_ms(sampler, logits, True, top_p, args.steps))
        ratio = min(seeded) / min(unseeded)
        print(f"top_p={top_p}: unseeded {min(unseeded):.1f} ms/step, seeded {min(seeded):.1f} ms/step ({ratio:.3f}x)")
    print(json.dumps({"bench": "sampler", "seeded_over_unseeded": round(ratio, 3)}))


if __name__ == "__main__":
    main()
