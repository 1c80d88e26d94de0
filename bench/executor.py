"""The model in a worker process against the model in the engine core's own process.

Same model and workload as bench/throughput.py (a ~110M Llama, random seeded weights, fp32; 64 requests
of 128 prompt + 128 new tokens, greedy, EOS ignored): LLM.generate's output tokens/s with
``distributed_executor_backend="uni"`` (in-process) and ``"mp"`` (a worker process), alternating, best
of --repeats each; then the cost of one step's round trip to the worker where it weighs most, a decode
step at batch 1 (median of 50). Target: mp/uni >= 0.95. Takes 3-5 minutes on 2 cores.

Last line: {"bench": "executor", "uni_tok_s": X, "mp_tok_s": Y, "ratio": R, "step_b1_uni_ms": A, "step_b1_mp_ms": B}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from throughput import MODEL, build_model, median_decode_step, tokens_per_second

from pdserve import LLM, SamplingParams
from pdserve.models.demo import ensure_demo_model

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # runs past every timed step


def _llm(folder: str, backend: str) -> LLM:
    return LLM(
        folder,
        tokenizer=str(ensure_demo_model()),
        max_model_len=512,
        kv_cache_memory=2 << 30,
        max_num_batched_tokens=2048,
        distributed_executor_backend=backend,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    best = {"uni": 0.0, "mp": 0.0}
    step = {"uni": 0.0, "mp": 0.0}
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder)
        print(
            f"workload: {args.requests} x {args.prompt_len} prompt + {args.new_tokens} new tokens, greedy", flush=True
        )
        for repeat in range(args.repeats):
            for backend in ("uni", "mp"):
                with _llm(folder, backend) as llm:
                    rate = tokens_per_second(llm, prompts, args.new_tokens)
                    if repeat == 0:
                        step[backend] = median_decode_step(llm.engine, prompts[:1], LONG, 50)
                best[backend] = max(best[backend], rate)
                print(f"  {backend:>3}: {rate:7.1f} output tok/s", flush=True)
    ratio = best["mp"] / best["uni"]
    print(f"best: in-process {best['uni']:.1f} tok/s, worker process {best['mp']:.1f} tok/s, ratio {ratio:.3f}")
    print(
        f"decode step at batch 1: in-process {step['uni'] * 1e3:.2f} ms, worker process {step['mp'] * 1e3:.2f} ms "
        f"({(step['mp'] - step['uni']) * 1e3:+.2f} ms: the round trip, within noise of the step)"
    )
    print(
        json.dumps(
            {
                "bench": "executor",
                "uni_tok_s": round(best["uni"], 1),
                "mp_tok_s": round(best["mp"], 1),
                "ratio": round(ratio, 3),
                "step_b1_uni_ms": round(step["uni"] * 1e3, 3),
                "step_b1_mp_ms": round(step["mp"] * 1e3, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
