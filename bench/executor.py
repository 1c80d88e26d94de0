"""The model in a worker process against the model in the engine core's own process.

Same model and workload as bench/throughput.py (a ~110M Llama, random seeded weights, fp32; 64 requests
of 128 prompt + 128 new tokens, greedy, EOS ignored): LLM.generate's output tokens/s with
``distributed_executor_backend="uni"`` (in-process) and ``"mp"`` (a worker process), alternating, best
of --repeats each; then the cost of one step's round trip to the worker where it weighs most, a decode
step at batch 1 (median of 50). Target: mp/uni >= 0.95. Then async scheduling (``"mp"`` with the core
scheduling step N+1 while the worker runs step N) on the same workload, and the share of the
synchronous mp run's wall time the core spent on its own work (scheduling, encoding, applying outputs,
detokenising: everything but waiting for the worker), which is what async scheduling can hide.
Takes 5-7 minutes on 2 cores.

Last line: {"bench": "executor", "uni_tok_s", "mp_tok_s", "ratio", "step_b1_uni_ms", "step_b1_mp_ms",
"async_tok_s", "async_gain", "core_share"}
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from throughput import MODEL, build_model, median_decode_step, tokens_per_second

from pdserve import LLM, SamplingParams
from pdserve.models.demo import ensure_demo_model

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # runs past every timed step


def _llm(folder: str, backend: str) -> LLM:
    """``backend``: uni, mp, or async (mp with async scheduling)."""
    return LLM(
        folder,
        tokenizer=str(ensure_demo_model()),
        max_model_len=512,
        kv_cache_memory=2 << 30,
        max_num_batched_tokens=2048,
        distributed_executor_backend="mp" if backend == "async" else backend,
        async_scheduling=backend == "async",
    )


def _time_waiting(llm: LLM) -> list[float]:
    """Accumulate (in the returned one-item list) the seconds the core waits for its worker."""
    executor = llm.engine.model_executor
    waited = [0.0]
    receive = executor._receive  # type: ignore[attr-defined]

    def timed(timeout):
        start = time.perf_counter()
        try:
            return receive(timeout)
        finally:
            waited[0] += time.perf_counter() - start

    executor._receive = timed  # type: ignore[attr-defined]
    return waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    best = {"uni": 0.0, "mp": 0.0, "async": 0.0}
    step = {"uni": 0.0, "mp": 0.0}
    core_share = 0.0
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder)
        print(
            f"workload: {args.requests} x {args.prompt_len} prompt + {args.new_tokens} new tokens, greedy", flush=True
        )
        for repeat in range(args.repeats):
            for backend in ("uni", "mp", "async"):
                with _llm(folder, backend) as llm:
                    waited = _time_waiting(llm) if backend == "mp" else None
                    start = time.perf_counter()
                    rate = tokens_per_second(llm, prompts, args.new_tokens)
                    if waited is not None and repeat == 0:
                        core_share = 1 - waited[0] / (time.perf_counter() - start)
                    if repeat == 0 and backend != "async":
                        step[backend] = median_decode_step(llm.engine, prompts[:1], LONG, 50)
                best[backend] = max(best[backend], rate)
                print(f"  {backend:>3}: {rate:7.1f} output tok/s", flush=True)
    ratio = best["mp"] / best["uni"]
    print(f"best: in-process {best['uni']:.1f} tok/s, worker process {best['mp']:.1f} tok/s, ratio {ratio:.3f}")
    print(
        f"decode step at batch 1: in-process {step['uni'] * 1e3:.2f} ms, worker process {step['mp'] * 1e3:.2f} ms "
        f"({(step['mp'] - step['uni']) * 1e3:+.2f} ms: the round trip, within noise of the step)"
    )
    gain = best["async"] / best["mp"]
    print(
        f"async scheduling: {best['async']:.1f} tok/s, {gain:.3f}x synchronous mp; the core's own work was "
        f"{core_share:.1%} of the synchronous mp run's wall time (what async scheduling can hide)"
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
                "async_tok_s": round(best["async"], 1),
                "async_gain": round(gain, 3),
                "core_share": round(core_share, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
