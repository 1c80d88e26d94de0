"""EngineArgs: everything needed to build an EngineCore, in one place for every way of running
one (the offline LLM, the engine-core process of the servers). The engine's role
(pdserve.api.roles) is part of it: a P/D role runs the KV connector, the colocated role does not."""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass, replace

import torch

from pdserve.api.roles import COLOCATED, engine_role
from pdserve.api.tokenizer import load_tokenizer
from pdserve.engine.block_pool import new_block_generations
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.reasoning import ReasoningMarkers, blank_token_test, reasoning_parser
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.structured_outputs import DEFAULT_COMPILE_TIMEOUT_S, StructuredOutputManager
from pdserve.kvtransfer.agent import TransferAgent
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector import PDConnectorScheduler
from pdserve.kvtransfer.layout import head_ranges
from pdserve.kvtransfer.params import kv_compat_hash
from pdserve.models.config import ModelConfig
from pdserve.models.demo import ensure_demo_model
from pdserve.models.dtype import resolve_dtype
from pdserve.models.fingerprint import weights_fingerprint
from pdserve.models.parallel import split_problem
from pdserve.worker.interface import ModelExecutor
from pdserve.worker.kv_cache import KV_CACHE_LAYOUT, STATE_SLOT_LAYOUT, RunnerConfig
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.multiproc import MultiprocExecutor
from pdserve.worker.process import WorkerSpec

logger = logging.getLogger(__name__)

EXECUTOR_BACKENDS = ("uni", "mp")
# llguidance would be the second; it has not earned its place (xgrammar covers every kind asked for).
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar",)


@dataclass
class EngineArgs:
    model: str | None = None  # an HF model folder; None: the built-in demo model
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = "auto"
    device: str | None = None  # defaults to cuda when available
    block_size: int = 16
    max_model_len: int | None = None  # defaults to the model's
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes, CPU
    gpu_memory_utilization: float = 0.9
    # Fixes the KV block count (tests, benchmarks); a hybrid model's max_num_seqs state slots come on top.
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    role: str = COLOCATED.name  # colocated | prefill | decode
    kv_transfer: KVTransferConfig | None = None  # P/D roles: how blocks move (default settings when None)
    kv_events_host: str = "127.0.0.1"  # where the core publishes KV-cache events for routers
    kv_events_port: int | None = 0  # 0: a free port; None: no events
    # Where the model runs: "uni" in the core's own process, "mp" in worker processes of their own.
    distributed_executor_backend: str = "uni"
    # Ranks the model is split over, one worker process each (more than 1 implies "mp").
    tensor_parallel_size: int = 1
    # Schedule step N+1 while the workers run step N (implies "mp": the workers need processes of their own).
    async_scheduling: bool = False
    # Structured outputs: the grammar library, the bound on one grammar's compile, and whether JSON
    # grammars allow free whitespace between tokens (off: compact JSON, as vLLM's disable_any_whitespace).
    structured_outputs_backend: str = "xgrammar"
    structured_outputs_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S
    structured_outputs_any_whitespace: bool = False
    # How a reasoning model marks its thinking (pdserve.engine.reasoning): the core keeps grammars off
    # the thinking, the API server moves it into reasoning_content. None: outputs are answers only.
    reasoning_parser: str | None = None
    # Import path ("module:Class") of a ModelRunner subclass to run instead (in-process executor only):
    # the tests' scripted runner, which makes a real model emit fixed token sequences.
    model_runner_cls: str | None = None

    def __post_init__(self) -> None:
        role = engine_role(self.role)
        if role.kv_transfer and self.kv_transfer is None:
            self.kv_transfer = KVTransferConfig()
        elif not role.kv_transfer and self.kv_transfer is not None:
            raise ValueError(f"the {role.name} role moves no KV blocks: kv_transfer settings need a P/D role")
        if self.kv_transfer is not None:  # the role says whether peers may read this engine's blocks
            self.kv_transfer = replace(self.kv_transfer, serves_blocks=role.serves_blocks)
        if self.tensor_parallel_size > 1 or self.async_scheduling:
            self.distributed_executor_backend = "mp"
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured outputs backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                f"got {self.structured_outputs_backend!r}"
            )
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError(
                f"the structured outputs compile timeout must be > 0 s, got {self.structured_outputs_compile_timeout}"
            )
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)  # raises for an unknown one
        if self.model_runner_cls is not None and self.distributed_executor_backend != "uni":
            raise ValueError("a model runner class replaces the in-process runner: it needs the uni executor")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed executor backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )

    def resolved_model(self) -> str:
        return self.model or str(ensure_demo_model())

    def build_engine_core(self) -> tuple[EngineCore, ModelConfig]:
        """Load the model onto its device (in this process, or in a worker process), then build the
        scheduler around the KV cache it sized; with P/D on, the transfer agent over that cache (next
        to it, in the worker) and the connector that drives it."""
        folder = self.resolved_model()
        model_config = ModelConfig.from_folder(folder)
        problem = split_problem(model_config, self.tensor_parallel_size)
        if problem is not None:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: {problem}")
        device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(self.dtype, device)
        max_model_len = self.max_model_len or model_config.max_model_len
        runner_config = RunnerConfig(
            model=folder,
            dtype=dtype,
            device=device,
            block_size=self.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            tp_size=self.tensor_parallel_size,
        )
        kv_transfer = self.kv_transfer
        compat_hash = ""
        heads = head_ranges(model_config.num_kv_heads, self.tensor_parallel_size)  # per rank
        if kv_transfer is not None:
            # Exactly what determines a token's KV: the weights, rope and window, the cache's dtype,
            # block size, shape and layout. Not the tensor-parallel size: engines of one model at
            # different TP sizes may pair (each rank's head ranges are a handshake matter), except
            # hybrid models, whose state slots are split by rank.
            compat_hash = kv_compat_hash(
                weights=weights_fingerprint(folder),
                architecture=model_config.architecture,
                routing=model_config.routing,
                rope_theta=model_config.rope_theta,
                rope_scaling=json.dumps(model_config.rope_scaling, sort_keys=True),
                sliding_window=model_config.sliding_window,
                layers=model_config.num_layers,
                kv_heads=model_config.num_kv_heads,
                head_dim=model_config.head_dim,
                dtype=str(dtype),
                block_size=self.block_size,
                layout=KV_CACHE_LAYOUT,
                # Hybrid models: which layers keep a state slot, how a slot lies in its rows, and (a rank's
                # slot holds its own value heads' state) the tensor-parallel size.
                layer_types=",".join(model_config.layer_types),
                state_layout=f"{STATE_SLOT_LAYOUT};tp={self.tensor_parallel_size}" if model_config.is_hybrid else "",
            )
        executor: ModelExecutor
        generations = None
        agent_ports = [0]
        if self.distributed_executor_backend == "mp":
            worker = MultiprocExecutor(WorkerSpec(model_config, runner_config, kv_transfer, compat_hash, heads))
            executor, num_blocks, description = worker, worker.num_blocks, worker.describe()
            cache_size = worker.cache_size
            generations, agent_ports = worker.generations, worker.agent_ports
        else:
            agents: list[TransferAgent] = []

            def make_agent(kv_cache: torch.Tensor) -> TransferAgent:
                # The agent registers the KV cache and the block generations with its transport,
                # so both exist before the scheduler's block pool, which is then built on them.
                assert kv_transfer is not None
                block_generations = new_block_generations(kv_cache.shape[0])  # every row, state slots' too
                agent = TransferAgent(kv_transfer, kv_cache, block_generations, compat_hash, heads)
                agents.append(agent)
                return agent

            runner_cls = _import_class(self.model_runner_cls) if self.model_runner_cls else ModelRunner
            runner = runner_cls(model_config, runner_config, make_agent if kv_transfer is not None else None)
            executor, num_blocks, description = runner, runner.num_blocks, runner.describe()
            cache_size = runner.cache_size
            if agents:
                generations, agent_ports = agents[0].generations, [agents[0].port]
        logger.info(
            "%s engine: model %s (%s, %s on %s); %s",
            self.role,
            folder,
            model_config.architecture,
            dtype,
            device,
            description,
        )
        if model_config.is_hybrid and self.enable_prefix_caching:
            logger.info(
                "prefix caching is off: %s has linear-attention layers, whose state at a cached block is not kept",
                model_config.architecture,
            )
        connector = None
        if kv_transfer is not None:
            assert generations is not None  # the agent made them
            connector = PDConnectorScheduler(
                kv_transfer, compat_hash, self.block_size, agent_ports, generations, cache_size.rows_per_state_slot
            )
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=self.block_size,
                max_model_len=max_model_len,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_prefix_caching=self.enable_prefix_caching,
                num_state_slots=cache_size.num_state_slots,
                rows_per_state_slot=cache_size.rows_per_state_slot,
            ),
            connector,
            generations,
        )
        reasoning = None
        if self.reasoning_parser is not None:
            tokenizer = load_tokenizer(self.tokenizer or folder)
            markers = ReasoningMarkers.of(reasoning_parser(self.reasoning_parser), tokenizer)
            reasoning = (markers, blank_token_test(tokenizer))
        structured_outputs = StructuredOutputManager(
            self.tokenizer or folder,
            model_config.vocab_size,
            model_config.eos_token_ids,
            self.structured_outputs_compile_timeout,
            self.structured_outputs_any_whitespace,
            reasoning,
        )
        return EngineCore(scheduler, executor, self.async_scheduling, structured_outputs), model_config


def _import_class(path: str) -> type[ModelRunner]:
    module, _, name = path.partition(":")
    runner_cls = getattr(importlib.import_module(module), name)
    if not (isinstance(runner_cls, type) and issubclass(runner_cls, ModelRunner)):
        raise ValueError(f"{path} is not a ModelRunner subclass")
    return runner_cls
