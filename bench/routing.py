"""Prefix-aware routing against round-robin on a shared-prefix workload: prefix-cache hit rate, TTFT, throughput.
About 3 minutes on 2 cores (4-5 with ``--policies prefix-load prefix-load-gateway round-robin``: the same choice
made by ``pdserve epp`` behind a real Envoy, whose hit rate should match the router's).

Setup: two engines, each pinned to its own core (taskset, 1 torch thread), behind `pdserve router` (unpinned,
sharing the cores with the load generator in this process). The engines are `pdserve decode` processes with no
prefill pods, so the router sends every request decode-only and each engine computes whole prompts: on 2 cores
this shows the routing effect best: a third process (a prefill engine) would take a core from the engines whose
caches are being compared, and the KV pull adds nothing the routing changes. Each policy gets fresh engines
(empty caches) and the same arrival sequence.

Model: the ~85M Llama of bench/pd_vs_colocated.py (fp32), with KV caches of about 100 blocks of 16 tokens per
engine. Workload: `pdserve bench --workload shared-prefix`, 10 prefixes of 256 tokens (160 blocks in all, more
than one engine holds), each request a prefix plus a random 48-token suffix, 8 output tokens, Poisson arrivals.
Round-robin sends every prefix to both engines, which then evict each other's prefixes; prefix-load keeps each
prefix on the engine that has it (unless that engine is much busier), so each engine holds half the prefixes.

Hit rate: the engines' own counters (pdserve_prefix_cache_hits_total / _queries_total, both engines). Also shown:
the router's predicted vs realised decode hits (from usage in the streams' last event) and how requests split.

With --plot DIR, writes DIR/routing.png. Last line JSON {"bench": "routing", "hit_rate_prefix_load",
"hit_rate_round_robin", "ttft_p50_prefix_load_ms", "ttft_p50_round_robin_ms", ...}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pd_vs_colocated import build_model, free_port, start
from plots import add_plot_argument, bar_chart
from prefix_cache import prefix_counters, shared_prefix_load

from pdserve.testing.envoy import Envoy
from pdserve.testing.metrics import metric, scrape
from pdserve.testing.processes import cpu_engine_flags, router_argv

ENGINE_FLAGS = cpu_engine_flags("112MiB", served_model_name="bench")
POLICIES = ("prefix-load", "round-robin")
GATEWAY = "-gateway"  # a policy's choice made by `pdserve epp` behind Envoy instead of by the router


def run(folder: Path, policy: str, args: argparse.Namespace, scratch: Path) -> dict:
    processes = []
    try:
        for core in (0, 1):
            port = free_port()
            argv = ["decode", "--port", str(port), "--model", str(folder), *ENGINE_FLAGS]
            processes.append(start(f"{policy}-engine{core}", port, argv, scratch, str(core)))
        engines = [process.url for process in processes]
        for process in processes:
            process.wait_healthy(300)
        port = free_port()
        routing = policy.removesuffix(GATEWAY)
        flags = ("--routing", routing, "--tokenizer", str(folder), "--load-weight", str(args.load_weight))
        argv = router_argv(port, [], engines, *flags)
        envoy = None
        if policy.endswith(GATEWAY):  # the same choice made by the endpoint picker, behind a real Envoy
            grpc_port = free_port()
            argv = ["epp", "--grpc-port", str(grpc_port), *argv[1:]]
        router = start(f"{policy}-router", port, argv, scratch)
        processes.append(router)
        router.wait_healthy(300)
        if policy.endswith(GATEWAY):
            envoy = Envoy(scratch, free_port(), grpc_port, free_port())
            envoy.wait_ready()
        try:
            summary = shared_prefix_load(envoy.url if envoy else router.url, args, seed=7)
        finally:
            if envoy is not None:
                envoy.stop()
        hits = queries = 0.0
        for url in engines:
            engine_hits, engine_queries = prefix_counters(url)
            hits, queries = hits + engine_hits, queries + engine_queries
        summary["hit_rate"] = hits / max(queries, 1.0)
        counters = scrape(router.url)
        summary["predicted"] = metric(counters, "pdserve_router_prefix_blocks_predicted_total", role="decode")
        summary["realised"] = metric(counters, "pdserve_router_prefix_blocks_realised_total", role="decode")
        summary["split"] = [
            metric(counters, "pdserve_router_choices_total", pod=url, policy=routing, role="decode") for url in engines
        ]
        return summary
    finally:
        for process in reversed(processes):
            process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--request-rate", type=float, default=1.5)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=10)
    parser.add_argument("--suffix-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--load-weight", type=float, default=4.0, help="the router's --load-weight (prefix-load)")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        choices=["prefix-load", "round-robin", "prefix", "least-load", f"prefix-load{GATEWAY}"],
    )
    add_plot_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        folder = scratch / "model"
        build_model(folder)
        results = {policy: run(folder, policy, args, scratch) for policy in args.policies}
    print(
        f"{args.num_prompts} requests: {args.num_prefixes} prefixes x {args.prefix_len} tokens + "
        f"{args.suffix_len}-token suffix, {args.output_len} out, Poisson {args.request_rate}/s; 2 engines, one core "
        f"each; prefix-load's --load-weight {args.load_weight}"
    )
    print(
        f"{'policy':<12} {'hit rate':>9} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'req/s':>6} {'out tok/s':>9} "
        f"{'split':>9} {'predicted/realised blocks':>26}"
    )
    for policy, s in results.items():
        split = "/".join(f"{n:.0f}" for n in s["split"])
        print(
            f"{policy:<12} {s['hit_rate']:9.1%} {s['median_ttft_ms']:9.0f} {s['p90_ttft_ms']:7.0f} "
            f"{s['p99_ttft_ms']:7.0f} {s['request_throughput']:6.2f} {s['output_throughput']:9.1f} {split:>9} "
            f"{s['predicted']:>13.0f}/{s['realised']:<12.0f}"
        )
        if s["failed"]:
            print(f"  {s['failed']} failed: {s['errors']}")
    if set(POLICIES) - set(results):
        return  # an exploration run: no plot, no summary line
    if args.plot:
        bar_chart(
            args.plot,
            "routing",
            "shared-prefix workload, 2 engines: prefix-load vs round-robin (bench/routing.py)",
            "ms  |  %",
            {
                "TTFT p50 (ms)": {p: results[p]["median_ttft_ms"] for p in POLICIES},
                "TTFT p90 (ms)": {p: results[p]["p90_ttft_ms"] for p in POLICIES},
                "prompt tokens from cache (%)": {p: results[p]["hit_rate"] * 100 for p in POLICIES},
            },
        )
    load, rr = results["prefix-load"], results["round-robin"]
    gateway = results.get(f"prefix-load{GATEWAY}")
    extra = {} if gateway is None else {"hit_rate_prefix_load_gateway": round(gateway["hit_rate"], 3)}
    print(
        json.dumps(
            {
                **extra,
                "bench": "routing",
                "hit_rate_prefix_load": round(load["hit_rate"], 3),
                "hit_rate_round_robin": round(rr["hit_rate"], 3),
                "ttft_p50_prefix_load_ms": round(load["median_ttft_ms"], 1),
                "ttft_p50_round_robin_ms": round(rr["median_ttft_ms"], 1),
                "ttft_p90_prefix_load_ms": round(load["p90_ttft_ms"], 1),
                "ttft_p90_round_robin_ms": round(rr["p90_ttft_ms"], 1),
                "req_s_prefix_load": round(load["request_throughput"], 2),
                "req_s_round_robin": round(rr["request_throughput"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
