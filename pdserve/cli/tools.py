"""The tool commands: ``bench`` (load test), ``profile`` and ``plan`` (size pools), ``keys`` (a deployment's
key folder), ``demo-model`` (the built-in tiny models) and ``build-kernels`` (the CPU kernels, built once per
installation)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys

from pdserve.api.auth import API_KEY_ENV
from pdserve.api.flags import parse_size
from pdserve.api.keys import ENGINE_FILES, ROTATION_STEPS, ROUTER_FILES
from pdserve.api.roles import COLOCATED
from pdserve.cli.engine import add_engine_flags, engine_args
from pdserve.kvtransfer.config import TRANSPORTS
from pdserve.models.families import DEMO_FAMILIES


def add_tool_commands(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)")
    bench.add_argument("--base-url", required=True, help="server URL without /v1, e.g. http://127.0.0.1:8000")
    bench.add_argument("--model", required=True)
    bench.add_argument("--num-prompts", type=int, default=100)
    bench.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default: all at once)")
    bench.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    bench.add_argument("--max-concurrency", type=int, default=None)
    bench.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    bench.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    bench.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0)
    bench.add_argument("--workload", choices=["random", "shared-prefix", "chat"], default="random")
    bench.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per prefix")
    bench.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    bench.add_argument("--vocab-size", type=int, default=1000, help="token ids are drawn below this")
    bench.add_argument("--tokenizer", default=None, help="accepted for vllm bench compatibility; prompts are token ids")
    bench.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request runs to length")
    bench.add_argument("--slo-ttft-ms", type=float, default=None)
    bench.add_argument("--slo-tpot-ms", type=float, default=None)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--result-file", "--result-filename", dest="result_file", default=None)
    bench.add_argument("--api-key", default=os.environ.get(API_KEY_ENV))
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(handler=_bench)
    profile = commands.add_parser("profile", help="measure an engine on this machine for `pdserve plan`")
    add_engine_flags(profile, kv_transfer=False)
    profile.add_argument("--output", "-o", required=True, help="the profile JSON to write")
    profile.add_argument("--kv-transfer", choices=TRANSPORTS, default="nixl", help="transport of the timed pulls")
    profile.add_argument(
        "--gpus-per-pod", type=int, default=None, help="GPUs of one pod (default: the TP size, 0 on CPU)"
    )
    profile.add_argument("--cpus-per-pod", type=float, default=1.0, help="the CPU request of a CPU pod (its cost)")
    profile.add_argument(
        "--max-batch", type=int, default=None, help="largest decode batch measured (default max-num-seqs)"
    )
    profile.set_defaults(handler=_profile, host="127.0.0.1", kv_side_channel_host=None, kv_events_port=-1)
    plan = commands.add_parser("plan", help="the cheapest prefill and decode pools that meet TTFT and TPOT targets")
    plan.add_argument("--profile", required=True, help="from `pdserve profile` (of the prefill pods, or of all)")
    plan.add_argument("--decode-profile", default=None, help="of the decode pods, when they differ")
    plan.add_argument(
        "--trace", default=None, help='JSON lines {"t", "prompt_tokens", "output_tokens"} instead of --rate'
    )
    plan.add_argument("--rate", type=float, default=1.0, help="requests/s")
    plan.add_argument("--burstiness", type=float, default=1.0, help="CV of the gaps: 1 Poisson, >1 bursty, 0 regular")
    plan.add_argument("--prompt-len", type=float, default=512, help="mean prompt tokens")
    plan.add_argument("--prompt-cv", type=float, default=0.5, help="their coefficient of variation (lognormal)")
    plan.add_argument("--output-len", type=float, default=128, help="mean output tokens")
    plan.add_argument("--output-cv", type=float, default=0.5)
    plan.add_argument("--prefix-hit-rate", type=float, default=0.0, help="share of each prompt that is a shared prefix")
    plan.add_argument(
        "--tier-hit-rate",
        type=float,
        default=0.0,
        help="share of each prompt, after its shared prefix, that KV tiers hold: loaded instead of computed",
    )
    plan.add_argument(
        "--tier-bandwidth",
        type=parse_size,
        default=None,
        help="bytes/s the KV tiers load into one engine, e.g. 2GiB (needed with --tier-hit-rate; default: the "
        "profile's tier_bytes_per_s)",
    )
    plan.add_argument("--duration", type=float, default=600.0, help="seconds of traffic to simulate")
    plan.add_argument("--ttft-ms", type=float, required=True)
    plan.add_argument("--tpot-ms", type=float, required=True)
    plan.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both")
    plan.add_argument("--max-prefill", type=int, default=16)
    plan.add_argument("--max-decode", type=int, default=32)
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--output", choices=["text", "json", "pdservice"], default="text")
    plan.add_argument("--pdservice", default=None, help="--output pdservice: the PDService manifest to size")
    plan.set_defaults(handler=_plan)
    keys = commands.add_parser(
        "keys", help="make a deployment's key folder, or take one step of rotating its keys (docs/faults.md)"
    )
    keys.add_argument("path", help="the key folder")
    keys.add_argument(
        "--rotate",
        choices=ROTATION_STEPS,
        default=None,
        help="add: a new key beside each (accepted, not used); promote: sign with the new keys; retire: drop the "
        "old ones. Let every process see each step before the next",
    )
    keys.set_defaults(handler=_keys)
    demo = commands.add_parser("demo-model", help="write the built-in tiny model and tokenizer to PATH")
    demo.add_argument("path", help="folder to write (created if missing)")
    demo.add_argument(
        "--family",
        default="qwen3",
        choices=list(DEMO_FAMILIES),
        help="the model family (default: qwen3, the model `pdserve serve` runs; qwen3-moe: 8 experts, top-2; "
        "qwen3.5: hybrid linear attention)",
    )
    demo.set_defaults(handler=_demo_model)
    build = commands.add_parser(
        "build-kernels", help="compile the CPU kernels for this installation (make setup and the image do it)"
    )
    build.add_argument("args", nargs=argparse.REMAINDER, help="passed to python -m pdserve.kernels.build")
    build.set_defaults(handler=_build_kernels)


def _keys(args: argparse.Namespace) -> int:
    from pdserve.api.keys import ALL_FILES, new_bundle, read_bundle, rotate, write_bundle

    if args.rotate is None:
        if any(os.path.exists(os.path.join(args.path, name)) for name in ALL_FILES):
            sys.stderr.write(f"{args.path} holds keys already: rotate them with --rotate {'|'.join(ROTATION_STEPS)}\n")
            return 2
        write_bundle(args.path, new_bundle())
        print(
            f"wrote {', '.join(ALL_FILES)} to {args.path}: give routers {' and '.join(ROUTER_FILES)}, "
            f"engines {', '.join(ENGINE_FILES)}"
        )
        return 0
    try:
        contents = rotate(read_bundle(args.path), args.rotate)
    except (OSError, ValueError) as error:
        sys.stderr.write(f"cannot rotate the keys in {args.path}: {error}\n")
        return 2
    write_bundle(args.path, contents)
    print(
        f"{args.path}: rotation step {args.rotate!r} done; let every process read it (2 s; on Kubernetes, the "
        f"Secret's propagation to every pod) before the next step"
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pdserve.bench.loadgen import BenchConfig, format_summary, run_benchmark

    config = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        arrival=args.arrival,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        workload=args.workload,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        vocab_size=args.vocab_size,
        ignore_eos=args.ignore_eos,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        seed=args.seed,
        api_key=args.api_key,
        progress=not args.no_progress,
    )
    summary = asyncio.run(run_benchmark(config))
    print(format_summary(summary))
    if args.result_file:
        with open(args.result_file, "w") as handle:
            json.dump(summary, handle, indent=2)
    return 0 if summary["completed"] else 1


def _profile(args: argparse.Namespace) -> int:
    from pdserve.bench.profile import profile_engine

    logging.getLogger("pdserve").setLevel("WARNING")
    profile = profile_engine(
        engine_args(args, COLOCATED, None),
        transport=args.kv_transfer,
        gpus_per_pod=args.gpus_per_pod,
        cpus_per_pod=args.cpus_per_pod,
        max_batch=args.max_batch,
    )
    profile.save(args.output)
    shape, transfer = profile.engine, profile.transfer
    print(
        f"{profile.model} on {profile.hardware}: {len(profile.step_points)} steps measured; "
        f"step seconds = {profile.step.describe()}, "
        f"median error {profile.step.median_error(profile.step_points):.0%}; "
        f"{shape.num_blocks} KV blocks of {shape.block_size} tokens ({shape.kv_bytes_per_token} B a token); "
        f"pulls {transfer.latency_s * 1000:.2f} ms + {transfer.bytes_per_s / 1e9:.2f} GB/s; wrote {args.output}"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    import yaml

    from pdserve.planner.profile import Profile
    from pdserve.planner.report import format_report, make_report, sized_pdservice
    from pdserve.planner.simulator import SLO
    from pdserve.planner.workload import Lengths, WorkloadSpec, read_trace

    try:
        profile = Profile.load(args.profile)
        if args.tier_bandwidth is not None:
            profile = dataclasses.replace(profile, tier_bytes_per_s=float(args.tier_bandwidth))
        decode_profile = Profile.load(args.decode_profile) if args.decode_profile else None
        slo = SLO(args.ttft_ms / 1000, args.tpot_ms / 1000, args.attainment)
        if args.trace:
            arrivals = read_trace(args.trace, args.seed)
            at_rate = None
        else:
            spec = WorkloadSpec(
                rate=args.rate,
                prompt=Lengths(args.prompt_len, args.prompt_cv),
                output=Lengths(args.output_len, args.output_cv),
                duration_s=args.duration,
                burstiness=args.burstiness,
                prefix_hit_rate=args.prefix_hit_rate,
                tier_hit_rate=args.tier_hit_rate,
                seed=args.seed,
                max_model_len=profile.engine.max_model_len,
            )
            if args.prompt_len >= profile.engine.max_model_len:
                raise ValueError(
                    f"--prompt-len must be below the profiled max_model_len ({profile.engine.max_model_len})"
                )
            arrivals, at_rate = spec.arrivals(), (lambda factor: spec.scaled(factor).arrivals())
        too_long = [a for a in arrivals if len(a.prompt) + a.output_tokens > profile.engine.max_model_len]
        if too_long:  # a trace's own lengths: say so rather than plan for requests the engines would cut short
            raise ValueError(
                f"{len(too_long)} requests need more than the profiled max_model_len ({profile.engine.max_model_len})"
            )
        report = make_report(arrivals, slo, profile, decode_profile, args.max_prefill, args.max_decode, at_rate)
        if args.output == "pdservice":
            with open(args.pdservice) as handle:
                print(yaml.safe_dump(sized_pdservice(yaml.safe_load(handle), report), sort_keys=False), end="")
        elif args.output == "json":
            print(json.dumps(report, indent=1))
        else:
            print(format_report(report))
    except (OSError, ValueError) as error:
        print(f"pdserve plan: {error}", file=sys.stderr)
        return 2
    return 0 if report["best"] is not None else 1


def _demo_model(args: argparse.Namespace) -> int:
    from pdserve.models.demo import write_demo_model

    path = write_demo_model(args.path, family=args.family)
    print(f"wrote the {args.family} demo model to {path}")
    return 0


def _build_kernels(args: argparse.Namespace) -> int:
    from pdserve.kernels.build import main

    return main(args.args)
