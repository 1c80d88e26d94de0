"""Colocated vs 1P1D on this machine, same offered load: TTFT, TPOT and goodput, and a plot.

Model: a ~85M Llama (hidden 768, 12 layers, 12 heads, intermediate 2048) with the demo model's
1024-token vocabulary, tokenizer and chat template, random seeded weights, fp32. Workload: random prompts of
512 tokens, 64 output tokens (EOS ignored), Poisson arrivals at --request-rate, through
`pdserve bench`'s load generator (in this process).

- colocated: one engine (`pdserve serve --mode colocated`), both cores, 2 torch threads;
- 1P1D: `pdserve prefill` pinned to core 0 and `pdserve decode` to core 1 (taskset, 1 thread
  each), `pdserve router` unpinned, KV over NIXL.

What 2 cores can show: with one core per role, decode steps never wait behind a prefill, so
TPOT is flat under load, while each role has half the compute (prefill is slower). What they
cannot: the router, the load generator and the transfer agents share the same two cores with
the engines, and there is no network between the "pods" (UCX moves KV through shared memory).

Prints a table (last line JSON) and, with --plot DIR, writes DIR/pd_vs_colocated.png. About 4 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from plots import add_plot_argument, pyplot, save

from pdserve.launcher import free_port
from pdserve.testing.processes import Process, cpu_engine_flags, router_argv, server_env

MODEL = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}
ENGINE_FLAGS = cpu_engine_flags("1GiB", max_model_len=1024, served_model_name="bench")


def build_model(folder: Path, max_position_embeddings: int = MODEL["max_position_embeddings"]) -> None:
    """The bench model in ``folder``: the seeded weights and the demo model's tokenizer files and chat template.
    ``max_position_embeddings`` changes no weight (RoPE stores none): a longer one only lets prompts grow."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdserve.models.demo import ensure_demo_model

    torch.manual_seed(0)
    config = LlamaConfig(**{**MODEL, "max_position_embeddings": max_position_embeddings})
    LlamaForCausalLM(config).eval().save_pretrained(str(folder))
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (demo / name).exists():
            shutil.copy(demo / name, folder / name)


def start(name: str, port: int, argv: list[str], logs: Path, cores: str | None = None, threads: int = 1) -> Process:
    """Start `pdserve ARGV` (listening on ``port``) with ``threads`` torch threads, pinned to ``cores`` when given,
    its output in LOGS/NAME.log."""
    process = Process(name, argv, server_env(threads), port, logs / f"{name}.log", cores=cores)
    process.start()
    return process


def run_load(url: str, args: argparse.Namespace) -> dict:
    from pdserve.bench.loadgen import BenchConfig, run_benchmark

    config = BenchConfig(
        base_url=url,
        model="bench",
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        ignore_eos=True,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        seed=1,
        progress=False,
    )
    warmup = BenchConfig(
        base_url=url, model="bench", num_prompts=2, input_len=64, output_len=4, ignore_eos=True, seed=2, progress=False
    )
    asyncio.run(run_benchmark(warmup))
    return asyncio.run(run_benchmark(config))


def run_setup(name: str, folder: Path, logs: Path, args: argparse.Namespace) -> dict:
    processes: list[Process] = []
    try:
        if name == "colocated":
            port = free_port()
            argv = ["serve", "--mode", "colocated", "--port", str(port), "--model", str(folder), *ENGINE_FLAGS]
            processes.append(start("colocated", port, argv, logs, "0,1", 2))
        else:
            for role, core in (("prefill", "0"), ("decode", "1")):
                port = free_port()
                argv = [role, "--port", str(port), "--model", str(folder), *ENGINE_FLAGS]
                processes.append(start(role, port, argv, logs, core))
            for process in processes:
                process.wait_healthy(300)
            prefill, decode = processes
            port = free_port()
            processes.append(start("router", port, router_argv(port, [prefill.url], [decode.url]), logs))
        processes[-1].wait_healthy(300)
        return run_load(processes[-1].url, args)
    finally:
        for process in processes:
            process.stop()


def plot(results: dict[str, dict], folder: Path) -> None:
    figure, axes = pyplot().subplots(1, 2, figsize=(10, 4))
    for name, summary in results.items():
        for axis, key, label in ((axes[0], "ttfts_ms", "TTFT (ms)"), (axes[1], "tpots_ms", "TPOT (ms)")):
            values = sorted(v for v in summary[key] if v is not None)
            axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
            axis.set_xlabel(label)
            axis.set_ylabel("fraction of requests")
            axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle("colocated vs 1P1D, 2 cores, same offered load (bench/pd_vs_colocated.py)")
    save(figure, folder, "pd_vs_colocated")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000)
    parser.add_argument("--slo-tpot-ms", type=float, default=100)
    add_plot_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        build_model(folder)
        results = {name: run_setup(name, folder, Path(scratch), args) for name in ("colocated", "1P1D")}
    print(
        f"{args.num_prompts} requests, {args.input_len} in / {args.output_len} out, Poisson {args.request_rate}/s; "
        f"SLO TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms"
    )
    print(
        f"{'setup':<10} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'TPOT p50':>9} {'p90':>7} {'p99':>7} "
        f"{'goodput':>8} {'tok/s':>7} {'failed':>6}"
    )
    for name, s in results.items():
        print(
            f"{name:<10} {s['median_ttft_ms']:9.0f} {s['p90_ttft_ms']:7.0f} {s['p99_ttft_ms']:7.0f} "
            f"{s['median_tpot_ms']:9.1f} {s['p90_tpot_ms']:7.1f} {s['p99_tpot_ms']:7.1f} "
            f"{s['goodput']:8.2f} {s['output_throughput']:7.1f} {s['failed']:6d}"
        )
    if args.plot:
        plot(results, args.plot)
    print(
        json.dumps(
            {
                "bench": "pd_vs_colocated",
                **{
                    f"{name}_{key}": round(s[key], 2)
                    for name, s in results.items()
                    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "goodput")
                },
            }
        )
    )


if __name__ == "__main__":
    main()
