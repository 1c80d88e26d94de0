"""Structured outputs: what a grammar on every request costs, in one command.

Model and workload: bench/throughput.py's (~110M Llama fp32, 64 requests x 128-token prompts, 128
new tokens, greedy), run by one engine twice, alternating: unconstrained, then every request under
a moderately complex JSON schema (nested objects in an array that cannot close within 128 tokens,
so both runs produce exactly 64 x 128 tokens), and again, `--rounds` times. Reports output tok/s of
each and their ratio (median over rounds), and the bitmask fill time per step.

Grammar compile times of the ten test schemas (pdserve.testing.schemas) for this model's
vocabulary: cold (a fresh compiler each round) and cached (the manager's spec-keyed cache), p50
and p99 over the rounds.

Last line: {"bench": "structured", "unconstrained_tok_s": X, "structured_tok_s": Y, "ratio": R,
"compile_cold_p50_ms": ..., "compile_cold_p99_ms": ..., "compile_cached_p50_ms": ...}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from throughput import MODEL, build_model

from pdserve import LLM, SamplingParams, StructuredOutputsParams
from pdserve.engine.request import Request
from pdserve.engine.structured_outputs import StructuredOutputManager
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.schemas import SCHEMAS

# An order of line items: each item a small object; at least 30 of them, so no output closes it in 128 tokens.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}},
        "priority": {"enum": ["low", "normal", "high"]},
        "items": {
            "type": "array",
            "minItems": 30,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "gift"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "priority", "items"],
    "additionalProperties": False,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def generation_tok_s(llm: LLM, prompts: list[list[int]], params: SamplingParams, new_tokens: int) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == len(prompts) * new_tokens, "every request runs to max_tokens"
    return num_tokens / elapsed


def compile_times(tokenizer: str, vocab_size: int, rounds: int) -> tuple[list[float], list[float]]:
    """(cold, cached) seconds to get each schema's grammar ready, over ``rounds`` rounds."""
    cold: list[float] = []
    cached: list[float] = []
    for round_index in range(rounds):
        manager = StructuredOutputManager(tokenizer, vocab_size, [2])
        # The token tables are built once per engine, not per grammar: by this first compile.
        warm_up = Request(
            f"warm-up-{round_index}", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
        )
        manager.add_request(warm_up)
        warm_up.structured_output.future.result()
        for pass_index in range(2):
            for index, schema in enumerate(SCHEMAS):
                params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
                request = Request(f"{round_index}-{pass_index}-{index}", [1], params)
                start = time.perf_counter()
                manager.add_request(request)
                request.structured_output.future.result()
                while not request.structured_output.ready:
                    manager.poll()
                (cold if pass_index == 0 else cached).append(time.perf_counter() - start)
        manager.close()
    return cold, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    demo = str(ensure_demo_model())
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder)
        # No prefix cache: the second run of the same prompts would otherwise skip their prefill.
        llm = LLM(
            folder,
            tokenizer=demo,
            max_model_len=512,
            kv_cache_memory=2 << 30,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
        )
        free = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        constrained = SamplingParams(
            temperature=0.0,
            max_tokens=args.new_tokens,
            ignore_eos=True,
            structured_outputs=StructuredOutputsParams(json=ORDER_SCHEMA),
        )
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        llm.generate(prompts[:4], constrained)  # compiles the schema: its compile is measured below
        print(
            f"workload: {args.requests} requests x {args.prompt_len} prompt + {args.new_tokens} new tokens, greedy; "
            f"vocabulary {MODEL['vocab_size']}",
            flush=True,
        )
        ratios, free_runs, constrained_runs, bitmask_ms = [], [], [], []
        for round_index in range(args.rounds):
            free_tok_s = generation_tok_s(llm, prompts, free, args.new_tokens)
            llm.engine.make_stats()  # drops the fill times so far
            constrained_tok_s = generation_tok_s(llm, prompts, constrained, args.new_tokens)
            fills = llm.engine.make_stats().grammar_bitmask_seconds
            bitmask_ms.append(statistics.median(fills) * 1e3)
            ratios.append(constrained_tok_s / free_tok_s)
            free_runs.append(free_tok_s)
            constrained_runs.append(constrained_tok_s)
            print(
                f"round {round_index + 1}: unconstrained {free_tok_s:7.1f} tok/s, JSON schema {constrained_tok_s:7.1f} "
                f"tok/s ({ratios[-1]:.3f}x); bitmask fill per step (batch {args.requests}) median "
                f"{bitmask_ms[-1]:.2f} ms",
                flush=True,
            )
        llm.close()
    cold, cached = compile_times(demo, MODEL["vocab_size"], args.rounds)
    print(
        f"compile of the 10 test schemas ({len(cold)} each): cold p50 {percentile(cold, 0.5) * 1e3:.2f} ms, "
        f"p99 {percentile(cold, 0.99) * 1e3:.2f} ms; cached p50 {percentile(cached, 0.5) * 1e3:.3f} ms, "
        f"p99 {percentile(cached, 0.99) * 1e3:.3f} ms"
    )
    ratio = statistics.median(ratios)
    print(f"structured / unconstrained output tok/s (median of {args.rounds}): {ratio:.3f}x")
    print(
        json.dumps(
            {
                "bench": "structured",
                "unconstrained_tok_s": round(statistics.median(free_runs), 1),
                "structured_tok_s": round(statistics.median(constrained_runs), 1),
                "ratio": round(ratio, 3),
                "bitmask_ms_per_step": round(statistics.median(bitmask_ms), 3),
                "compile_cold_p50_ms": round(percentile(cold, 0.5) * 1e3, 3),
                "compile_cold_p99_ms": round(percentile(cold, 0.99) * 1e3, 3),
                "compile_cached_p50_ms": round(percentile(cached, 0.5) * 1e3, 4),
                "compile_cached_p99_ms": round(percentile(cached, 0.99) * 1e3, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
