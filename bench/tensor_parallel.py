"""Tensor parallelism on this machine: TP 2 against TP 1, and what the collectives cost.

bench/throughput.py's model (a ~110M Llama, fp32): the median decode step with 1, 16 and 64
requests running, at TP 1 (the model in the engine core's process) and TP 2 (two worker processes,
gloo). Then the collectives of one TP-2 decode step timed on their own, in two gloo processes with
the same tensor sizes: per layer two all-reduces of [batch, hidden], one for the embedding, and the
all-gather of the logits; their sum against the TP-2 step is the all-reduce share. On a 2-core CPU
the two ranks share the cores that TP 1 uses alone, so TP 2 cannot be faster here; the figures say
what the split costs. Takes about 3 minutes.

Last line: {"bench": "tensor_parallel", "step_ms": {"tp1": {...}, "tp2": {...}}, "collective_share": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from throughput import MODEL, build_model, median_decode_step

BATCHES = (1, 16, 64)


def decode_steps_ms(folder: str, tp: int, batches: tuple[int, ...]) -> dict[int, float]:
    from pdserve import LLM, SamplingParams
    from pdserve.models.demo import ensure_demo_model

    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    prompt = [(7 * i) % MODEL["vocab_size"] for i in range(64)]
    with LLM(
        folder, tokenizer=str(ensure_demo_model()), max_model_len=512, kv_cache_memory=1 << 30, tensor_parallel_size=tp
    ) as llm:
        return {batch: median_decode_step(llm.engine, [prompt] * batch, params, 10) * 1e3 for batch in batches}


def collectives(rank: int, init: str, batches: tuple[int, ...]) -> None:
    """One of two gloo ranks: time one decode step's collectives per batch size; rank 0 prints them (ms)."""
    import torch

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    hidden, vocab, layers = MODEL["hidden_size"], MODEL["vocab_size"], MODEL["num_hidden_layers"]
    result = {}
    for batch in batches:
        reduce = torch.randn(batch, hidden)
        logits = torch.randn(batch, vocab // 2)
        parts = [torch.empty_like(logits) for _ in range(2)]
        for _ in range(5):
            torch.distributed.all_reduce(reduce)
            torch.distributed.all_gather(parts, logits)
        samples = []
        for _ in range(20):
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(2 * layers + 1):
                torch.distributed.all_reduce(reduce)
            torch.distributed.all_gather(parts, logits)
            samples.append(time.perf_counter() - start)
        result[batch] = statistics.median(samples) * 1e3
    if rank == 0:
        print(json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collectives", nargs=2, metavar=("RANK", "INIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collectives:
        collectives(int(args.collectives[0]), args.collectives[1], BATCHES)
        return
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder)
        steps = {tp: decode_steps_ms(folder, tp, BATCHES) for tp in (1, 2)}
        init = f"file://{os.path.join(folder, 'init')}"
        ranks = [
            subprocess.Popen(
                [sys.executable, __file__, "--collectives", str(rank), init], stdout=subprocess.PIPE, text=True
            )
            for rank in range(2)
        ]
        out, _ = ranks[0].communicate(timeout=300)
        ranks[1].wait(60)
        collective_ms = {int(batch): ms for batch, ms in json.loads(out.strip().splitlines()[-1]).items()}
    print(f"{'batch':>6}{'TP 1 step ms':>14}{'TP 2 step ms':>14}{'TP2/TP1':>9}{'collectives ms':>16}{'share':>8}")
    share = {}
    for batch in BATCHES:
        share[batch] = collective_ms[batch] / steps[2][batch]
        print(
            f"{batch:>6}{steps[1][batch]:>14.1f}{steps[2][batch]:>14.1f}{steps[2][batch] / steps[1][batch]:>9.2f}"
            f"{collective_ms[batch]:>16.2f}{share[batch]:>8.1%}"
        )
    print(
        json.dumps(
            {
                "bench": "tensor_parallel",
                "step_ms": {f"tp{tp}": {b: round(ms, 2) for b, ms in steps[tp].items()} for tp in (1, 2)},
                "collective_share": {b: round(s, 3) for b, s in share.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
