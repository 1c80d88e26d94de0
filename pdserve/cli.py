"""The ``pdserve`` command line: the one place that wires components together (docs/architecture.md).

Subcommands are added as their components land; each is a thin shell over its package, and heavy
imports (torch, the model code) happen only inside the subcommand that needs them. Flag names are
a contract (docs/contracts.md): vLLM's where vLLM has one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Iterator

from pdserve.api.auth import API_KEY_ENV
from pdserve.api.keys import ENGINE_FILES, KEYS_ENV, ROTATION_STEPS, ROUTER_FILES
from pdserve.api.roles import COLOCATED, DECODE, POOL_ROLES, PREFILL, ROUTER, ROUTER_PORT, Role, engine_role
from pdserve.engine.reasoning import REASONING_PARSERS
from pdserve.kvtransfer.config import TRANSPORTS
from pdserve.server.tool_parsers import TOOL_PARSERS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "4GiB", "512MiB", "1.5G" or a plain number of bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4GiB, 512MiB or a number of bytes)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "")[:1].upper()])


def _add_server_flags(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="require 'Authorization: Bearer KEY' on /v1 (default: env PDSERVE_API_KEY)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face model folder (default: the built-in demo model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: folder name)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, ...")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV cache size on CPU (default 2GiB)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--distributed-executor-backend",
        choices=["uni", "mp"],
        default="uni",
        help="where the model runs: uni, in the engine core's process; mp, in a worker process of its own",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="schedule the next step while the workers run this one (implies mp)",
    )
    parser.add_argument(
        "--structured-outputs-backend",
        choices=["xgrammar"],
        default="xgrammar",
        help="the grammar library of structured outputs (response_format, structured_outputs)",
    )
    parser.add_argument(
        "--structured-outputs-compile-timeout",
        type=float,
        default=10.0,
        help="seconds one grammar may take to compile; a request whose grammar takes longer gets a 400",
    )
    parser.add_argument(
        "--structured-outputs-any-whitespace",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let JSON grammars allow free whitespace between tokens (off: compact JSON only)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="how the model marks its thinking: it goes into reasoning_content, and structured outputs and "
        "tool calls apply to the answer after it",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help='read tool calls from answers (tool_choice "auto", the default with tools); hermes: '
        "Qwen's <tool_call>{...}</tool_call>",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many ranks, one worker process each (implies mp)",
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=4096,
        help="requests (choices) running or queued beyond which new ones get 503 + Retry-After",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take before it is aborted with 504 (default: no bound)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="on SIGTERM, seconds to let running requests finish and held KV blocks be pulled "
        "(default: the KV lease + 15 s)",
    )


def _add_key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-keys",
        default=os.environ.get(KEYS_ENV) or None,
        metavar="DIR",
        help=f"the deployment's key folder (`pdserve keys DIR` makes one): it authenticates the KV side channel, "
        f"the router's P/D legs and KV events; a router reads {' and '.join(ROUTER_FILES)}, an engine "
        f"{', '.join(ENGINE_FILES)} (default: env {KEYS_ENV})",
    )
    parser.add_argument(
        "--kv-insecure",
        action="store_true",
        help="run without keys on a non-loopback address: an engine without keys takes P/D params from any client "
        "(vLLM's proxy) and its side channel from any peer; only where the network itself keeps strangers out. "
        "An engine with keys checks them whatever this says",
    )


def _deployment_keys(args: argparse.Namespace, component: str, hosts: list[str], files: tuple[str, ...]) -> str | None:
    """The key folder (checked to hold ``files``), or None; exits when there is none but there must be."""
    from pdserve.api.auth import exposure_problem
    from pdserve.api.keys import KeyFileError, check_folder

    if args.kv_keys:
        try:
            check_folder(args.kv_keys, files, f"pdserve {component}")
        except KeyFileError as error:
            raise SystemExit(str(error)) from None
    problem = exposure_problem(f"pdserve {component}", hosts, args.kv_keys is not None, args.kv_insecure)
    if problem is not None:
        raise SystemExit(problem)
    if args.kv_keys is None:
        logging.getLogger("pdserve").warning(
            "pdserve %s: no keys: the KV side channel, P/D params and KV events are not authenticated (%s)",
            component,
            "--kv-insecure" if args.kv_insecure else "loopback addresses only",
        )
    return str(args.kv_keys) if args.kv_keys else None


def _add_kv_transfer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-transfer",
        choices=TRANSPORTS,
        default="nixl",
        help="how KV blocks move between engines: nixl where it exposes nothing beyond the KV cache (peers on "
        "this host, or UCX limited to RDMA), else the checked TCP transport; tcp: always the TCP transport",
    )
    parser.add_argument(
        "--kv-nixl-unbounded",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="use NIXL even over UCX transports that do not bound a peer's access (tcp, shared memory): EVERY "
        "PEER THAT HAND-SHAKES CAN THEN READ AND WRITE THIS PROCESS'S MEMORY (docs/faults.md)",
    )
    parser.add_argument(
        "--kv-side-channel-host",
        default=os.environ.get("PDSERVE_KV_HOST"),
        help="address of the KV side channel, advertised to decode engines (default: env PDSERVE_KV_HOST, else --host)",
    )
    parser.add_argument(
        "--kv-side-channel-port",
        type=int,
        default=0,
        help="rank 0's side channel; rank r of a tensor-parallel engine listens on it + r (0: free ports, advertised)",
    )
    parser.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=30.0,
        help="held blocks are freed if no decode engine takes or renews them within this time",
    )
    parser.add_argument(
        "--kv-transfer-timeout", type=float, default=10.0, help="seconds a handshake or one transfer may take"
    )
    parser.add_argument(
        "--kv-load-failure",
        choices=["recompute", "fail"],
        default="recompute",
        help="what a failed or expired pull does: recompute the prompt locally, or fail the request",
    )
    parser.add_argument(
        "--kv-max-held-fraction",
        type=float,
        default=0.5,
        help="share of the KV cache a prefill engine holds for decode engines at once; beyond it a prefill leg "
        "answers without params and its decode computes the prompt",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=0,
        help="where the engine publishes KV-cache events for routers (0: a free port, advertised in /health; -1: none)",
    )
    _add_key_flags(parser)


# The engine flags `pdserve serve` forwards to its children (dest -> flag).
_FORWARDED_ENGINE_FLAGS = (
    "model",
    "tokenizer",
    "served_model_name",
    "dtype",
    "device",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "enable_prefix_caching",
    "distributed_executor_backend",
    "async_scheduling",
    "structured_outputs_backend",
    "structured_outputs_compile_timeout",
    "structured_outputs_any_whitespace",
    "reasoning_parser",
    "tool_call_parser",
    "kv_transfer",
    "kv_nixl_unbounded",
    "kv_lease_seconds",
    "kv_transfer_timeout",
    "kv_load_failure",
    "kv_max_held_fraction",
    "max_pending_requests",
    "request_timeout",
    "drain_timeout",
    "log_level",
)


def _forwarded_argv(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    argv = []
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _engine_args(args: argparse.Namespace, role: Role, keys_dir: str | None):  # -> EngineArgs (imported lazily)
    from pdserve.engine.engine_args import EngineArgs

    kv_transfer = None
    if role.kv_transfer:
        from pdserve.kvtransfer.config import KVTransferConfig

        kv_transfer = KVTransferConfig(
            keys_dir=keys_dir,
            nixl_unbounded=args.kv_nixl_unbounded,
            transport=args.kv_transfer,
            host=args.kv_side_channel_host or args.host,
            side_channel_port=args.kv_side_channel_port,
            lease_seconds=args.kv_lease_seconds,
            transfer_timeout=args.kv_transfer_timeout,
            load_failure=args.kv_load_failure,
            max_held_fraction=args.kv_max_held_fraction,
        )
    return EngineArgs(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        role=role.name,
        distributed_executor_backend=args.distributed_executor_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        async_scheduling=args.async_scheduling,
        structured_outputs_backend=args.structured_outputs_backend,
        structured_outputs_compile_timeout=args.structured_outputs_compile_timeout,
        structured_outputs_any_whitespace=args.structured_outputs_any_whitespace,
        reasoning_parser=args.reasoning_parser,
        kv_transfer=kv_transfer,
        kv_events_host=args.kv_side_channel_host or args.host,
        kv_events_port=None if args.kv_events_port < 0 else args.kv_events_port,
    )


async def _wait_for_signal(*others: asyncio.Event) -> None:
    """Until SIGTERM or SIGINT, or until one of ``others`` is set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    waits = [asyncio.create_task(event.wait()) for event in (stop, *others)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def _run_engine(args: argparse.Namespace, role: Role) -> None:
    from pdserve.server.app import start_engine_server
    from pdserve.server.serving import ServerLimits

    limits = ServerLimits(max_in_flight=args.max_pending_requests, request_timeout=args.request_timeout)
    keys_dir = None
    verifier = None
    if role.kv_transfer:  # a colocated engine has no side channel and takes no P/D params
        hosts = [args.host, args.kv_side_channel_host or args.host]
        keys_dir = _deployment_keys(args, role.name, hosts, ENGINE_FILES)
    engine_args = _engine_args(args, role, keys_dir)
    if keys_dir is not None:  # with keys, P/D params come from the router only, whatever --kv-insecure says
        from pdserve.api.auth import RouterVerifier
        from pdserve.api.keys import load_router_public

        verifier = RouterVerifier(load_router_public(keys_dir), engine_args.kv_transfer.engine_id)
    running = await start_engine_server(
        engine_args,
        args.host,
        args.port,
        args.served_model_name,
        args.api_key,
        limits,
        verifier,
        args.tool_call_parser,
    )
    print(f"pdserve {role.name} engine serving {running.server.model_name} at {running.url}/v1", flush=True)
    client = running.server.client
    await _wait_for_signal(client.died)
    log = logging.getLogger("pdserve")
    if client.died.is_set():
        # Its requests were answered 503 when it died; nothing can serve more: exit, so the pod restarts.
        log.error("the engine core died: stopping")
        await running.close()
        raise SystemExit(1)
    timeout = args.drain_timeout if args.drain_timeout is not None else args.kv_lease_seconds + 15
    log.info("draining: refusing new requests; waiting up to %.0f s for running ones and held KV blocks", timeout)
    if not await running.drain(timeout):
        log.warning("drain timed out: stopping with work still in flight")
    log.info("shutting down: closing connections, stopping the engine core")
    await running.close()


def _engine(args: argparse.Namespace) -> int:
    logging.getLogger("pdserve").setLevel(args.log_level.upper())
    asyncio.run(_run_engine(args, engine_role(args.command)))
    return 0


async def _run_router(args: argparse.Namespace) -> None:
    from pdserve.router import RouterConfig, start_router

    if args.discovery == "static" and not args.decode:
        raise SystemExit("pdserve router: --decode URL ... is required with --discovery static")
    keys_dir = _deployment_keys(args, ROUTER, [args.host], ROUTER_FILES)
    running = await start_router(
        RouterConfig(
            prefill_urls=args.prefill,
            decode_urls=args.decode or [],
            api_key=args.api_key,
            discovery=args.discovery,
            namespace=args.namespace,
            selector=args.selector,
            routing=args.routing,
            tokenizer=args.tokenizer,
            prefix_weight=args.prefix_weight,
            load_weight=args.load_weight,
            pd_min_prefill_tokens=args.pd_min_prefill_tokens,
            prefill_timeout=args.prefill_timeout,
            session_affinity=args.session_affinity,
            keys_dir=keys_dir,
        ),
        args.host,
        args.port,
    )
    pods = (
        f"prefill: {', '.join(args.prefill) or 'none'}; decode: {', '.join(args.decode)}"
        if args.discovery == "static"
        else f"pods found by Kubernetes discovery ({args.selector or 'all'})"
    )
    print(f"pdserve router serving at {running.url}/v1 ({pods})", flush=True)
    await _wait_for_signal()
    await running.close()


def _router(args: argparse.Namespace) -> int:
    logging.getLogger("pdserve").setLevel(args.log_level.upper())
    asyncio.run(_run_router(args))
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.mode == COLOCATED.name:
        if args.prefill_tp is not None or args.decode_tp is not None:
            sys.stderr.write("--prefill-tp and --decode-tp size P/D pools: use -tp with --mode colocated\n")
            return 2
        args.command = COLOCATED.name
        return _engine(args)
    from pdserve.launcher import run_disaggregated

    if args.prefill < 1 or args.decode < 1:
        sys.stderr.write("--prefill and --decode must be at least 1\n")
        return 2
    sizes = {
        role: args.tensor_parallel_size if size is None else size
        for role, size in ((PREFILL.name, args.prefill_tp), (DECODE.name, args.decode_tp))
    }
    if min(sizes.values()) < 1:
        sys.stderr.write("--prefill-tp, --decode-tp and --tensor-parallel-size must be at least 1\n")
        return 2
    logging.getLogger("pdserve").setLevel(args.log_level.upper())
    if args.model is None:
        from pdserve.models.demo import ensure_demo_model

        args.model = str(ensure_demo_model())  # built once here, not raced by every child
    if args.api_key:  # children read it from the environment: a command line is visible to every user
        os.environ[API_KEY_ENV] = args.api_key
    insecure = ["--kv-insecure"] if args.kv_insecure else []
    with _local_keys(args) as (router_keys, engine_keys):
        router_argv = [*_forwarded_argv(args, ("log_level",)), "--tokenizer", args.tokenizer or args.model, *insecure]
        engine_argv = [*_forwarded_argv(args, _FORWARDED_ENGINE_FLAGS), *insecure]
        if router_keys is not None and engine_keys is not None:
            router_argv += ["--kv-keys", router_keys]
            engine_argv += ["--kv-keys", engine_keys]
        return run_disaggregated(args.host, args.port, args.prefill, args.decode, engine_argv, router_argv, sizes)


@contextlib.contextmanager
def _local_keys(args: argparse.Namespace) -> Iterator[tuple[str | None, str | None]]:
    """The key folders of `pdserve serve`'s router and engines: the one given (each child reads its own files),
    none under --kv-insecure (its children then take P/D params from any client, as the flag says), else fresh
    keys in a private temporary folder, the router's files and the engines' apart, removed at the end."""
    if args.kv_keys:
        yield args.kv_keys, args.kv_keys
        return
    if args.kv_insecure:
        yield None, None
        return
    from pdserve.api.keys import new_bundle, write_bundle

    with tempfile.TemporaryDirectory(prefix="pdserve-keys-") as folder:
        bundle = new_bundle()
        router, engine = os.path.join(folder, "router"), os.path.join(folder, "engine")
        write_bundle(router, bundle, ROUTER_FILES)
        write_bundle(engine, bundle, ENGINE_FILES)
        yield router, engine


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
    import json

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
        _engine_args(args, COLOCATED, None),
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
    import json

    import yaml

    from pdserve.planner.profile import Profile
    from pdserve.planner.report import format_report, make_report, sized_pdservice
    from pdserve.planner.simulator import SLO
    from pdserve.planner.workload import Lengths, WorkloadSpec, read_trace

    try:
        profile = Profile.load(args.profile)
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


def _operator(args: argparse.Namespace) -> int:
    from pdserve.operator import run

    logging.getLogger("pdserve").setLevel(args.log_level.upper())
    run(namespace=args.namespace, liveness_port=args.liveness_port)
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from pdserve.models.demo import write_demo_model

    path = write_demo_model(args.path, family=args.family)
    print(f"wrote the {args.family} demo model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode-disaggregated LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API locally: router + prefill + decode processes "
        "(--mode disagg, default) or one engine (--mode colocated)",
    )
    serve.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    serve.add_argument("--prefill", type=int, default=1, help="number of prefill engines (disagg)")
    serve.add_argument("--decode", type=int, default=1, help="number of decode engines (disagg)")
    serve.add_argument(
        "--prefill-tp", type=int, default=None, help="tensor-parallel size of each prefill engine (default: -tp)"
    )
    serve.add_argument(
        "--decode-tp", type=int, default=None, help="tensor-parallel size of each decode engine (default: -tp)"
    )
    _add_server_flags(serve, ROUTER_PORT)
    _add_engine_flags(serve)
    _add_kv_transfer_flags(serve)
    serve.set_defaults(handler=_serve)
    for role in POOL_ROLES:
        engine = commands.add_parser(
            role.name, help=f"run one {role.name} engine (OpenAI API + KV transfer), as a pod does"
        )
        _add_server_flags(engine, role.default_port)
        _add_engine_flags(engine)
        _add_kv_transfer_flags(engine)
        engine.set_defaults(handler=_engine)
    router = commands.add_parser(ROUTER, help="run the router: prefill leg, then decode leg streamed back")
    _add_server_flags(router, ROUTER_PORT)
    _add_key_flags(router)
    router.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill engine URLs (without /v1)")
    router.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode engine URLs (without /v1)")
    router.add_argument(
        "--discovery",
        choices=["static", "kubernetes"],
        default="static",
        help="static: the URLs given; kubernetes: watch the pods matching --selector",
    )
    router.add_argument("--namespace", default=None, help="kubernetes discovery: namespace (default: the router's)")
    router.add_argument("--selector", default="", help="kubernetes discovery: label selector of the engine pods")
    router.add_argument(
        "--routing",
        choices=["round-robin", "least-load", "prefix", "prefix-load"],
        default="prefix-load",
        help="pod choice: prefix policies match the prompt against the "
        "engines' KV-cache events (they need --tokenizer; without it, least-load)",
    )
    router.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="the served model's folder: prompts are tokenized and hashed as the engines do",
    )
    router.add_argument(
        "--prefix-weight", type=float, default=1.0, help="prefix-load: score per cached leading prompt block"
    )
    router.add_argument(
        "--load-weight",
        type=float,
        default=4.0,
        help="prefix-load: score lost per request running or queued on the pod",
    )
    router.add_argument(
        "--pd-min-prefill-tokens",
        type=int,
        default=256,
        help="skip the prefill leg when the decode pod lacks fewer prompt tokens (0: never skip)",
    )
    router.add_argument(
        "--prefill-timeout",
        type=float,
        default=None,
        help="seconds a prefill leg may take before decode computes the prompt and the pod leaves rotation until "
        "its health check passes (default: 2 s + 4x what the pod's measured prefill speed says the prompt needs)",
    )
    router.add_argument(
        "--session-affinity",
        action="store_true",
        help="keep a session (X-Session-Id header, else the body's user) on one pod per role",
    )
    router.set_defaults(handler=_router)
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
    _add_engine_flags(profile)
    profile.add_argument("--output", "-o", required=True, help="the profile JSON to write")
    profile.add_argument("--kv-transfer", choices=TRANSPORTS, default="nixl", help="transport of the timed pulls")
    profile.add_argument(
        "--gpus-per-pod", type=int, default=None, help="GPUs of one pod (default: the TP size, 0 on CPU)"
    )
    profile.add_argument("--cpus-per-pod", type=float, default=1.0, help="the CPU request of a CPU pod (its cost)")
    profile.add_argument(
        "--max-batch", type=int, default=None, help="largest decode batch measured (default max-num-seqs)"
    )
    profile.set_defaults(
        handler=_profile, host="127.0.0.1", kv_side_channel_host=None, kv_events_port=-1, kv_nixl_unbounded=False
    )
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
    operator = commands.add_parser("operator", help="run the Kubernetes operator (PDService and PDPool resources)")
    operator.add_argument("--namespace", default=None, help="watch one namespace (default: all namespaces)")
    operator.add_argument("--liveness-port", type=int, default=8080, help="serves /healthz for the liveness probe")
    operator.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    operator.set_defaults(handler=_operator)
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
        choices=["qwen3", "qwen3-moe", "qwen3.5"],  # models.demo.FAMILIES (not imported here: it imports torch)
        help="the model family (default: qwen3, the model `pdserve serve` runs; qwen3-moe: 8 experts, top-2; "
        "qwen3.5: hybrid linear attention)",
    )
    demo.set_defaults(handler=_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
