"""EngineArgs: the settings of one engine, in one place for every way of running one (the offline LLM,
the engine-core process of the servers), and the command-line flags that set them.

Only settings live here: fields, their validation, their flags (``pdserve.api.flags``). Building an engine
from them is ``pdserve.engine.build``'s, so reading them imports no model code and no torch (the API
process reads them). The engine's role (pdserve.api.roles) is part of them: a P/D role runs a KV
connector, the colocated role does not.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from pdserve.api.flags import add_flags, flag, flag_values, parse_positive_ints, parse_size
from pdserve.api.roles import COLOCATED, engine_role
from pdserve.engine.reasoning import REASONING_PARSERS
from pdserve.engine.scheduler_config import SCHEDULING_POLICIES
from pdserve.engine.structured_outputs import DEFAULT_COMPILE_TIMEOUT_S
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connectors import KV_CONNECTORS
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.models.config import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES
from pdserve.worker.executors import EXECUTORS

# llguidance would be the second; it has not earned its place (xgrammar covers every kind asked for).
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar",)


@dataclass
class EngineArgs:
    model: str | None = field(
        default=None, metadata=flag("Hugging Face model folder (default: the built-in demo model)")
    )
    tokenizer: str | None = field(default=None, metadata=flag("tokenizer folder (default: the model's)"))
    dtype: str = field(default="auto", metadata=flag("auto (float32 on CPU, bfloat16 on GPU), float32, ..."))
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "what the KV cache stores: auto (the model's dtype), bfloat16 or float16 (half an fp32 cache; read back "
            "into float32), float32, fp8_e4m3 (half a 16-bit cache: K and V divided by a scale per layer, the "
            "checkpoint's or 1.0; on CPU through the slower torch reference path)",
            choices=(*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES),
        ),
    )
    device: str | None = field(default=None, metadata=flag("cpu or cuda (default: cuda when available)"))
    block_size: int = field(default=16, metadata=flag("tokens per KV-cache block"))
    max_model_len: int | None = field(default=None, metadata=flag("longest prompt + output (default: the model's)"))
    max_num_seqs: int = field(default=256, metadata=flag("requests running at once"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag("tokens one step computes at most"))
    kv_cache_memory: int | None = field(
        default=None,
        metadata=flag("KV cache size on CPU (default 2GiB, less where the memory limit leaves less)", parse=parse_size),
    )
    cpu_threads: int | None = field(
        default=None,
        metadata=flag(
            "compute threads of a CPU engine, all tensor-parallel ranks together (default: OMP_NUM_THREADS, else "
            "from the CPU affinity and the cgroup's CPU quota)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=flag("share of the GPU's memory the model and its KV cache may take")
    )
    enforce_eager: bool = field(
        default=False, metadata=flag("GPU: run every step eagerly, capturing no CUDA graphs (no effect on CPU)")
    )
    cuda_graph_sizes: str | None = field(
        default=None,
        metadata=flag(
            "GPU: the decode batch sizes captured as CUDA graphs, comma-separated (default: 1, 2, 4, then every 8 "
            "up to --max-num-seqs, at most 256); a decode step pads to the next size, larger ones run eagerly "
            "(no effect on CPU)",
            parse=parse_positive_ints,
        ),
    )
    # Fixes the KV block count (tests, benchmarks); a hybrid model's max_num_seqs state slots come on top.
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = field(default=True, metadata=flag("reuse the KV of prompts' cached prefixes"))
    role: str = COLOCATED.name  # colocated | prefill | decode (the command, not a flag)
    kv_transfer: KVTransferConfig | None = None  # P/D roles: how blocks move (default settings when None)
    kv_tiers: KVTierConfig | None = None  # the KV tiers below the pool (None: none)
    # The KV connector of a P/D role (pdserve/kvtransfer/connectors.py).
    kv_connector: str = field(
        default="pd", metadata=flag("the KV connector of a P/D engine", choices=tuple(KV_CONNECTORS))
    )
    kv_events_host: str = "127.0.0.1"  # where the core publishes KV-cache events for routers
    kv_events_port: int | None = field(
        default=0,
        metadata=flag(
            "where the engine publishes KV-cache events for routers (0: a free port, advertised in /health; -1: none)"
        ),
    )
    distributed_executor_backend: str = field(
        default="uni",
        metadata=flag(
            "where the model runs: uni, in the engine core's process; mp, in a worker process of its own",
            choices=tuple(EXECUTORS),
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag("split the model over this many ranks, one worker process each (implies mp)", aliases=("-tp",)),
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=flag(
            "fcfs: requests run in arrival order; priority: by the request's priority (lower first), a request "
            "that finds no room preempting running ones of a larger value",
            choices=SCHEDULING_POLICIES,
        ),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=flag("schedule the next step while the workers run this one (implies mp)"),
    )
    structured_outputs_backend: str = field(
        default="xgrammar",
        metadata=flag(
            "the grammar library of structured outputs (response_format, structured_outputs)",
            choices=STRUCTURED_OUTPUTS_BACKENDS,
        ),
    )
    structured_outputs_compile_timeout: float = field(
        default=DEFAULT_COMPILE_TIMEOUT_S,
        metadata=flag("seconds one grammar may take to compile; a request whose grammar takes longer gets a 400"),
    )
    # Off: compact JSON only, as vLLM's disable_any_whitespace.
    structured_outputs_any_whitespace: bool = field(
        default=False, metadata=flag("let JSON grammars allow free whitespace between tokens (off: compact JSON only)")
    )
    # How a reasoning model marks its thinking (pdserve.engine.reasoning): the core keeps grammars off
    # the thinking, the API server moves it into reasoning_content. None: outputs are answers only.
    reasoning_parser: str | None = field(
        default=None,
        metadata=flag(
            "how the model marks its thinking: it goes into reasoning_content, and structured outputs and "
            "tool calls apply to the answer after it",
            choices=tuple(sorted(REASONING_PARSERS)),
        ),
    )
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
        if self.kv_events_port is not None and self.kv_events_port < 0:  # the flag's "-1: none"
            self.kv_events_port = None
        if self.tensor_parallel_size > 1 or self.async_scheduling:
            self.distributed_executor_backend = "mp"
        _check_choice("structured outputs backend", self.structured_outputs_backend, STRUCTURED_OUTPUTS_BACKENDS)
        _check_choice("KV connector", self.kv_connector, KV_CONNECTORS)
        if self.kv_connector == "tiers":  # the tiers run on every role, composed with a P/D role's connector
            raise ValueError("--kv-connector names a P/D role's connector; the KV tiers are turned on by --kv-tier-*")
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError(
                f"the structured outputs compile timeout must be > 0 s, got {self.structured_outputs_compile_timeout}"
            )
        if self.reasoning_parser is not None:
            _check_choice("reasoning parser", self.reasoning_parser, REASONING_PARSERS)
        if self.model_runner_cls is not None and self.distributed_executor_backend != "uni":
            raise ValueError("a model runner class replaces the in-process runner: it needs the uni executor")
        _check_choice("distributed executor backend", self.distributed_executor_backend, EXECUTORS)
        if self.cuda_graph_sizes is not None:
            try:
                self.cuda_graph_sizes = parse_positive_ints(self.cuda_graph_sizes)
            except argparse.ArgumentTypeError as error:
                raise ValueError(f"--cuda-graph-sizes: {error}") from None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
        """The engine's flags (vLLM's names where vLLM has one: docs/contracts.md)."""
        add_flags(parser, EngineArgs, exclude)

    @classmethod
    def from_cli_args(
        cls,
        args: argparse.Namespace,
        role: str,
        kv_transfer: KVTransferConfig | None,
        events_host: str,
        kv_tiers: KVTierConfig | None = None,
    ) -> EngineArgs:
        return cls(
            **flag_values(args, cls), role=role, kv_transfer=kv_transfer, kv_tiers=kv_tiers, kv_events_host=events_host
        )


def _check_choice(what: str, value: str, table: Collection[str]) -> None:
    if value not in table:
        raise ValueError(f"{what} must be one of {', '.join(table)}, got {value!r}")
