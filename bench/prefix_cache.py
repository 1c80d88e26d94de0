"""Prefix caching on a shared-prefix workload: hit rate and TTFT with caching on and off.

The model and engine flags of bench/pd_vs_colocated.py (a ~85M Llama, fp32, colocated engine on
both cores). Workload: `pdserve bench --workload shared-prefix`: 4 prefixes of 384 tokens, each
request one of them plus a 64-token random suffix, 16 output tokens, Poisson arrivals. The hit
rate is the engine's own count (pdserve_prefix_cache_hits_total / _queries_total).

Prints a table (last line JSON) and, with --plot DIR, writes DIR/prefix_cache.png. About 3 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from pd_vs_colocated import ENGINE_FLAGS, build_model, free_port, start
from plots import add_plot_argument, pyplot, save

from pdserve.testing.metrics import metric, scrape


def prefix_counters(url: str) -> tuple[float, float]:
    """The engine's prefix-cache hits and queries so far (tokens)."""
    values = scrape(url)
    return metric(values, "pdserve_prefix_cache_hits_total"), metric(values, "pdserve_prefix_cache_queries_total")


def shared_prefix_load(url: str, args: argparse.Namespace, seed: int) -> dict:
    """`pdserve bench --workload shared-prefix` against ``url`` with the run's workload arguments: its summary."""
    from pdserve.bench.loadgen import BenchConfig, run_benchmark

    config = BenchConfig(
        base_url=url,
        model="bench",
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        workload="shared-prefix",
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        input_len=args.suffix_len,
        output_len=args.output_len,
        ignore_eos=True,
        seed=seed,
        progress=False,
    )
    return asyncio.run(run_benchmark(config))


def run(folder: Path, caching: bool, args: argparse.Namespace, logs: Path) -> dict:
    port = free_port()
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    argv = ["serve", "--mode", "colocated", "--port", str(port), "--model", str(folder), flag, *ENGINE_FLAGS]
    process = start(f"caching-{'on' if caching else 'off'}", port, argv, logs, "0,1", 2)
    try:
        process.wait_healthy(300)
        hits_before, queries_before = prefix_counters(process.url)
        summary = shared_prefix_load(process.url, args, seed=3)
        hits, queries = prefix_counters(process.url)
        summary["hit_rate"] = (hits - hits_before) / max(queries - queries_before, 1)
        return summary
    finally:
        process.stop()


def plot(results: dict[str, dict], folder: Path) -> None:
    names = list(results)
    figure, axes = pyplot().subplots(1, 2, figsize=(9, 3.5))
    width = 0.35
    for offset, key, label in ((-width / 2, "median_ttft_ms", "p50"), (width / 2, "p90_ttft_ms", "p90")):
        axes[0].bar([i + offset for i in range(len(names))], [results[n][key] for n in names], width, label=label)
    axes[0].set_xticks(range(len(names)), names)
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(names, [results[n]["hit_rate"] * 100 for n in names], color="tab:green")
    axes[1].set_ylabel("prompt tokens from the prefix cache (%)")
    figure.suptitle("shared-prefix workload, prefix caching on vs off (bench/prefix_cache.py)")
    save(figure, folder, "prefix_cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    add_plot_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        build_model(folder)
        results = {
            name: run(folder, name == "caching on", args, Path(scratch)) for name in ("caching on", "caching off")
        }
    print(
        f"{args.num_prompts} requests: {args.num_prefixes} prefixes x {args.prefix_len} tokens + "
        f"{args.suffix_len}-token suffix, {args.output_len} out, Poisson {args.request_rate}/s"
    )
    print(f"{'':<12} {'hit rate':>9} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'req/s':>6}")
    for name, s in results.items():
        print(
            f"{name:<12} {s['hit_rate']:9.1%} {s['median_ttft_ms']:9.0f} {s['p90_ttft_ms']:7.0f} "
            f"{s['p99_ttft_ms']:7.0f} {s['request_throughput']:6.2f}"
        )
    if args.plot:
        plot(results, args.plot)
    on, off = results["caching on"], results["caching off"]
    print(
        json.dumps(
            {
                "bench": "prefix_cache",
                "hit_rate": round(on["hit_rate"], 3),
                "ttft_p50_on_ms": round(on["median_ttft_ms"], 1),
                "ttft_p50_off_ms": round(off["median_ttft_ms"], 1),
                "ratio": round(off["median_ttft_ms"] / on["median_ttft_ms"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
