"""A 16-bit KV cache under an fp32 model on CPU (``--kv-cache-dtype``): what it holds, how fast it runs and how
far its outputs move, against the fp32 cache, in one command.

Model: ``throughput.py``'s ~110M Llama (fp32, random seeded weights; 12 layers, 12 KV heads of 64: 72 KiB of
fp32 KV a token). For each KV dtype (float32, bfloat16, float16), in alternating rounds (``--rounds``, medians
reported):

- **capacity**: the tokens a ``--kv-cache-memory`` budget holds;
- **throughput**: output tok/s of ``LLM.generate`` at batch 64 (128 prompt + 128 new tokens) and batch 1, and
  the median decode step at batch 16 over a long context (``--long-context`` tokens each), where attention
  reads the most KV per step;
- **accuracy** (once): the fp32 cache's greedy tokens for the 64 prompts, then each 16-bit cache's logprob
  of every one of those tokens fed back as a prompt (prompt logprobs: the same positions, teacher-forced):
  the largest and the mean absolute difference; and its own greedy tokens: how many of the 64 continuations
  equal fp32's, and where the first differs.

Takes ~10 minutes on 2 cores. Last line: {"bench": "kv_dtype", ...} with the medians.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import pdserve  # noqa: F401  (before torch loads: how its OpenMP threads wait, pdserve.OPENMP_ENV)

# isort: split
import torch
from cpu_matmul import cpu_name
from throughput import MODEL, build_model, median_decode_step, tokens_per_second

from pdserve import LLM, SamplingParams
from pdserve.api.flags import parse_size
from pdserve.models.demo import ensure_demo_model

DTYPES = ("float32", "bfloat16", "float16")
# Capacity and accuracy only: on CPU an 8-bit cache is read by the torch reference path (no fused kernel), so
# its speed says nothing about the kernels a GPU runs.
ACCURACY_ONLY = ("fp8_e4m3",)


def engine(folder: str, kv_dtype: str, memory: int, max_model_len: int) -> LLM:
    return LLM(
        folder,
        tokenizer=str(ensure_demo_model()),
        kv_cache_dtype=kv_dtype,
        kv_cache_memory=memory,
        max_model_len=max_model_len,
        max_num_batched_tokens=2048,
    )


def throughput_round(
    llm: LLM, prompts: list[list[int]], long_prompts: list[list[int]], new_tokens: int
) -> dict[str, float]:
    batch_64 = tokens_per_second(llm, prompts, new_tokens)
    batch_1 = tokens_per_second(llm, prompts[:1], new_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    long_step = median_decode_step(llm.engine, long_prompts, params, steps=8)
    return {"batch_64_tok_s": batch_64, "batch_1_tok_s": batch_1, "long_context_step_ms": long_step * 1e3}


def accuracy(llm: LLM, reference: list[list[int]], prompts: list[list[int]], reference_logprobs: list[list[float]]):
    """(max |logprob difference|, mean, greedy continuations equal to fp32's, first divergences)."""
    forced = logprobs_of(llm, reference)
    differences = [
        abs(a - b)
        for ours, theirs in zip(forced, reference_logprobs, strict=True)
        for a, b in zip(ours, theirs, strict=True)
    ]
    new_tokens = len(reference[0]) - len(prompts[0])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    divergences = []
    for output, expected in zip(outputs, reference, strict=True):
        got = output.outputs[0].token_ids
        want = expected[len(output.prompt_token_ids) :]
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if first is not None:
            divergences.append(first)
    return max(differences), statistics.fmean(differences), len(prompts) - len(divergences), sorted(divergences)


def logprobs_of(llm: LLM, sequences: list[list[int]]) -> list[list[float]]:
    """Each sequence's prompt logprobs of its own tokens (teacher-forced), positions 1..end."""
    outputs = llm.generate(
        [{"prompt_token_ids": sequence} for sequence in sequences],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
    )
    result = []
    for output, sequence in zip(outputs, sequences, strict=True):
        steps = output.prompt_logprobs[1:]
        result.append([step[token].logprob for step, token in zip(steps, sequence[1:], strict=True)])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory", type=parse_size, default=parse_size("1GiB"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long-context", type=int, default=768)
    args = parser.parse_args()
    rng = random.Random(0)
    vocab = MODEL["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    long_prompts = [[rng.randrange(vocab) for _ in range(args.long_context)] for _ in range(16)]
    max_model_len = args.long_context + 128
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder)
        engines = {
            dtype: engine(folder, dtype, args.kv_cache_memory, max_model_len) for dtype in DTYPES + ACCURACY_ONLY
        }
        for dtype, llm in engines.items():
            tokens = llm.engine.config.num_blocks * llm.engine.config.block_size
            print(f"{dtype:>9} KV: {tokens} tokens in {args.kv_cache_memory / 2**30:.2f} GiB", flush=True)

        reference_outputs = engines["float32"].generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        )
        reference = [o.prompt_token_ids + o.outputs[0].token_ids for o in reference_outputs]
        reference_logprobs = logprobs_of(engines["float32"], reference)
        accuracy_rows = {}
        for dtype in DTYPES[1:] + ACCURACY_ONLY:
            worst, mean, equal, divergences = accuracy(engines[dtype], reference, prompts, reference_logprobs)
            accuracy_rows[dtype] = {"max_logprob_diff": worst, "mean_logprob_diff": mean, "equal_greedy": equal}
            print(
                f"{dtype:>9} KV vs float32: logprob |diff| max {worst:.4f} mean {mean:.5f} over "
                f"{len(reference) * (len(reference[0]) - 1)} positions; greedy continuations equal {equal}/"
                f"{len(prompts)} (first differing token of the others: {divergences})",
                flush=True,
            )

        rounds: dict[str, list[dict[str, float]]] = {dtype: [] for dtype in DTYPES}
        for round_index in range(args.rounds):
            order = DTYPES if round_index % 2 == 0 else DTYPES[::-1]
            for dtype in order:
                start = time.perf_counter()
                figures = throughput_round(engines[dtype], prompts, long_prompts, args.new_tokens)
                rounds[dtype].append(figures)
                print(
                    f"round {round_index + 1} {dtype:>9}: batch 64 {figures['batch_64_tok_s']:.1f} tok/s, batch 1 "
                    f"{figures['batch_1_tok_s']:.1f} tok/s, batch-16 decode step at {args.long_context} tokens "
                    f"{figures['long_context_step_ms']:.1f} ms ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
        medians = {
            dtype: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for dtype, rows in rounds.items()
        }
        base = medians["float32"]
        for dtype in DTYPES:
            row = medians[dtype]
            print(
                f"median {dtype:>9}: batch 64 {row['batch_64_tok_s']:.1f} tok/s "
                f"({row['batch_64_tok_s'] / base['batch_64_tok_s']:.3f}x), batch 1 {row['batch_1_tok_s']:.1f} "
                f"({row['batch_1_tok_s'] / base['batch_1_tok_s']:.3f}x), long-context step "
                f"{row['long_context_step_ms']:.1f} ms "
                f"({base['long_context_step_ms'] / row['long_context_step_ms']:.3f}x)"
            )
        print(json.dumps({"bench": "kv_dtype", "medians": medians, "accuracy": accuracy_rows}))


if __name__ == "__main__":
    main()
