"""The engine's composition root: from ``EngineArgs`` to a running ``EngineCore``.

The one module of the core that imports concrete parts (torch, the model stack, the executors, the KV
connectors and transfer agents; ``tests/test_layering.py`` keeps it so): everything else in the core
works through the step contract (``worker.interface``), the connector interface (``kvtransfer.base``), the
P/D params' wire format (``kvtransfer.params``) and the torch-free settings and tables that name
implementations (``kvtransfer.config``, ``kvtransfer.connectors``, ``worker.executors``). The offline
``LLM``, the engine-core process of the servers and ``pdserve profile`` build here, so an engine is put
together one way wherever it runs.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.api.registry import load_row, resolve
from pdserve.api.tokenizer import load_tokenizer
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.reasoning import ReasoningMarkers, blank_token_test, reasoning_parser
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_config import SchedulerConfig
from pdserve.engine.structured_outputs import StructuredOutputManager
from pdserve.kvtransfer.base import KVConnectorScheduler
from pdserve.kvtransfer.connectors import ConnectorContext, make_connector
from pdserve.kvtransfer.layout import head_ranges
from pdserve.kvtransfer.params import model_compat_hash
from pdserve.models.config import ModelConfig
from pdserve.models.demo import ensure_demo_model
from pdserve.models.dtype import dtype_name, resolve_dtype, resolve_kv_cache_dtype
from pdserve.models.fingerprint import weights_fingerprint
from pdserve.models.parallel import split_problem
from pdserve.worker.cpu_budget import CpuBudget, choose_threads
from pdserve.worker.executors import EXECUTORS, LoadedExecutor
from pdserve.worker.kv_cache import KV_CACHE_LAYOUT, STATE_SLOT_LAYOUT, RunnerConfig
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.process import WorkerSpec

logger = logging.getLogger(__name__)


def model_folder(args: EngineArgs) -> str:
    """The model's folder: the one given, or the built-in demo model's (written on first use)."""
    return args.model or str(ensure_demo_model())


def build_engine_core(args: EngineArgs) -> tuple[EngineCore, ModelConfig, CpuBudget | None]:
    """Load the model onto its device (in this process, or in worker processes: the executor's row), then
    build the scheduler around the KV cache it sized; with P/D on, the connector over the transfer agents
    the executor started next to the cache. The CPU budget its compute threads came from (None on a GPU)."""
    started = time.perf_counter()
    folder = model_folder(args)
    model_config = ModelConfig.from_folder(folder)
    problem = split_problem(model_config, args.tensor_parallel_size)
    if problem is not None:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: {problem}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device)
    if kv_dtype == torch.float8_e4m3fn and device.type == "cpu":
        logger.warning(
            "--kv-cache-dtype fp8_e4m3 on CPU: no fused CPU kernel reads 8-bit KV, so attention runs the torch "
            "reference path (several times slower than a 16-bit cache, which also halves an fp32 one)"
        )
    budget = None
    if device.type == "cpu":
        budget = choose_threads(args.cpu_threads, args.tensor_parallel_size)
        logger.info("CPU compute threads: %d per rank (%s)", budget.threads, budget.reason)
    elif args.cpu_threads is not None:
        logger.info("--cpu-threads %d does not apply: the model runs on %s", args.cpu_threads, device)
    if device.type != "cuda" and (args.enforce_eager or args.cuda_graph_sizes):
        logger.info(
            "--enforce-eager and --cuda-graph-sizes do not apply: CUDA graphs are a GPU's (the model runs on %s)",
            device,
        )
    max_model_len = args.max_model_len or model_config.max_model_len
    runner_config = RunnerConfig(
        model=folder,
        dtype=dtype,
        device=device,
        kv_cache_dtype=kv_dtype,
        block_size=args.block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        tp_size=args.tensor_parallel_size,
        cpu_threads=budget.threads if budget is not None else None,
        # Ranks of a larger size share the CPUs in lockstep: each would count the others as contention.
        follow_contention=budget is not None and budget.detected and args.tensor_parallel_size == 1,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=[int(size) for size in args.cuda_graph_sizes.split(",")] if args.cuda_graph_sizes else None,
    )
    if args.kv_tiers is not None:
        _check_tiers(args, model_config, device)
    compat_hash = ""
    if args.kv_transfer is not None or args.kv_tiers is not None:
        compat_hash = model_compat_hash(
            model_config,
            weights_fingerprint(folder),
            str(dtype),
            args.block_size,
            args.tensor_parallel_size,
            KV_CACHE_LAYOUT,
            STATE_SLOT_LAYOUT,
            str(kv_dtype),
        )
    heads = head_ranges(model_config.num_kv_heads, args.tensor_parallel_size)  # per rank
    spec = WorkerSpec(model_config, runner_config, args.kv_transfer, args.kv_tiers, compat_hash, heads)
    start = resolve(EXECUTORS, args.distributed_executor_backend, "distributed executor backend")
    loaded: LoadedExecutor = start(spec, _runner_class(args.model_runner_cls))
    logger.info(
        "%s engine: model %s (%s, %s on %s); %s",
        args.role,
        folder,
        model_config.architecture,
        dtype_name(dtype),
        device,
        loaded.description,
    )
    if model_config.is_hybrid and args.enable_prefix_caching:
        logger.info(
            "prefix caching is off: %s has linear-attention layers, whose state at a cached block is not kept",
            model_config.architecture,
        )
    connector: KVConnectorScheduler | None = None
    names = ([args.kv_connector] if args.kv_transfer is not None else []) + (["tiers"] if args.kv_tiers else [])
    if names:
        context = ConnectorContext(
            compat_hash,
            args.block_size,
            args.block_size * model_config.kv_bytes_per_token(kv_dtype),
            args.tensor_parallel_size,
            args.kv_transfer,
            args.kv_tiers,
            loaded.agent_ports,
            loaded.generations,
            loaded.cache_size.rows_per_state_slot,
        )
        connector = make_connector(names, context)
    cache_size = loaded.cache_size
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=cache_size.num_blocks,
            block_size=args.block_size,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            num_state_slots=cache_size.num_state_slots,
            rows_per_state_slot=cache_size.rows_per_state_slot,
            scheduling_policy=args.scheduling_policy,
        ),
        connector,
        loaded.generations,
    )
    reasoning = None
    if args.reasoning_parser is not None:
        tokenizer = load_tokenizer(args.tokenizer or folder)
        markers = ReasoningMarkers.of(reasoning_parser(args.reasoning_parser), tokenizer)
        reasoning = (markers, blank_token_test(tokenizer))
    structured_outputs = StructuredOutputManager(
        args.tokenizer or folder,
        model_config.vocab_size,
        model_config.eos_token_ids,
        args.structured_outputs_compile_timeout,
        args.structured_outputs_any_whitespace,
        reasoning,
    )
    core = EngineCore(
        scheduler,
        loaded.executor,
        args.async_scheduling,
        structured_outputs,
        dtype_name(kv_dtype),
        loaded.startup_phases,
    )
    core.startup_seconds = time.perf_counter() - started
    return core, model_config, budget


def _check_tiers(args: EngineArgs, model_config: ModelConfig, device: torch.device) -> None:
    """KV tiers are keyed by the prefix cache's block hashes, and a host tier needs a device cache."""
    assert args.kv_tiers is not None
    if model_config.is_hybrid:
        raise ValueError(
            f"KV tiers are not supported for {model_config.architecture}: its linear-attention state at a block "
            "boundary is not kept, so its blocks cannot be cached (docs/kv-cache.md)"
        )
    if not args.enable_prefix_caching:
        raise ValueError("KV tiers need prefix caching (their blocks are found by the prefix cache's hashes)")
    if args.kv_tiers.host_bytes and device.type == "cpu":
        raise ValueError(
            "--kv-tier-host-bytes: this engine's KV cache is in host memory already (it runs on the CPU), so a "
            "host tier would only copy blocks within the same memory; grow --kv-cache-memory or use --kv-tier-disk"
        )


def _runner_class(path: str | None) -> type[ModelRunner] | None:
    """The ``module:Class`` of ``EngineArgs.model_runner_cls``, checked to be a ModelRunner."""
    if path is None:
        return None
    runner_cls = load_row(path)
    if not (isinstance(runner_cls, type) and issubclass(runner_cls, ModelRunner)):
        raise ValueError(f"{path} is not a ModelRunner subclass")
    return runner_cls
