"""The KV-cache tensors of one device: their layout, their size from a memory budget, their allocation;
and, for hybrid models, the linear-attention state slots beside them.

The KV cache is one block-major tensor (see ``allocate_kv_cache``): each block's KV for every layer
is one contiguous region (what the KV connectors register and move), and each layer's K and V
caches are strided views of it. Its size comes from a memory budget: on CPU ``kv_cache_memory``
bytes, or without it ``DEFAULT_CPU_KV_CACHE_BYTES`` cut down to what the cgroup's memory limit leaves
(``cpu_kv_budget``: never past it, so a tight pod gets a smaller cache rather than an OOM kill); on GPU the
free memory left at ``gpu_memory_utilization`` after the weights and the peak of a profiling forward pass
(vLLM's determine_available_memory approach).

A hybrid model's attention layers use the KV cache; its linear-attention layers keep one state slot
per running request, in rows of the same tensor past the pool's blocks: slot s is rows
``[num_blocks + s * rows_per_slot, ...)``, each linear layer's convolution window and recurrent
state at fixed offsets in them (``state_views``). So a slot moves between engines like blocks do:
same registration, same descriptors, same generations. The budget is split by what a request
needs at ``max_model_len``: its slot plus that many tokens of KV. That many slots (at most
``max_num_seqs``) are reserved, and the rest of the budget becomes KV blocks.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.metadata import build_attention_metadata
from pdserve.models.config import ModelConfig
from pdserve.models.transformer import CausalLM
from pdserve.worker.cpu_budget import CgroupLimits, read_cgroup_limits
from pdserve.worker.cuda_graphs import graph_pool_estimate, graph_sizes

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
# Kept free under a memory limit beyond what the cgroup holds when the cache is sized (weights loaded): the
# activations of a step at max_num_batched_tokens, the tokenizer and heaps of the API process, the transfer
# agent's buffers. A floor plus a share of the limit, so a large pod keeps room in proportion.
CPU_MEMORY_MARGIN_BYTES = 512 << 20
CPU_MEMORY_MARGIN_SHARE = 0.10
# Names the KV cache layout below; engines exchanging blocks must agree on it (KV compatibility hash).
KV_CACHE_LAYOUT = "blocks,layers,kv,heads,block_size,head_dim"
# And the layout of a state slot in its rows: per linear layer, conv window then recurrent state.
STATE_SLOT_LAYOUT = "layers,conv[channels,width-1],recurrent[value_heads,key_dim,value_dim]f32,align64"
_STATE_ALIGN = 64  # a cache line: a state starts where one does
# Where a CPU cache starts: numpy's data sit 16 bytes into their allocation, and vector loads of rows
# that straddle cache lines made the fused Gated DeltaNet kernel 3.5x slower (docs/benchmarks.md).
_MEMORY_ALIGN = 4096


@dataclass
class RunnerConfig:
    model: str
    dtype: torch.dtype
    device: torch.device
    kv_cache_dtype: torch.dtype | None = None  # what the KV cache stores (None: the model's dtype)
    block_size: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes (CPU); None: DEFAULT_CPU_KV_CACHE_BYTES within the memory limit
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # fixes the block count, overriding the memory budget
    max_num_seqs: int = 256  # the most state slots a hybrid model needs (one per running request)
    # Tensor parallelism: this runner is rank ``tp_rank`` of ``tp_size`` (the budget above is per rank).
    tp_rank: int = 0
    tp_size: int = 1
    cpu_threads: int | None = None  # compute threads of this rank on CPU (None: torch's default)
    # CPU, one rank, threads detected rather than given: fewer of them while other processes take the CPUs.
    follow_contention: bool = False
    enforce_eager: bool = False  # GPU: no CUDA graphs
    cuda_graph_sizes: list[int] | None = None  # GPU: the decode batch sizes captured (None: the default ladder)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype


@dataclass(frozen=True)
class CacheSize:
    """How much of each kind of cache a device holds."""

    num_blocks: int
    num_state_slots: int = 0  # zero unless the model has linear-attention layers
    rows_per_state_slot: int = 0  # block-sized rows each slot takes past the pool's blocks

    @property
    def num_rows(self) -> int:
        """Rows of the cache tensor: the pool's blocks, then the state slots."""
        return self.num_blocks + self.num_state_slots * self.rows_per_state_slot


def _state_offsets(config: ModelConfig, dtype: torch.dtype) -> tuple[list[tuple[int, int]], int]:
    """Each linear layer's (conv offset, recurrent offset) in a slot's bytes, and the slot's bytes
    (``dtype``: the model's, which the convolution window is kept in)."""
    conv_bytes = config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * dtype.itemsize
    recurrent_bytes = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    offsets, end = [], 0
    for _ in config.linear_layers:
        conv = end
        recurrent = -(-(conv + conv_bytes) // _STATE_ALIGN) * _STATE_ALIGN
        end = -(-(recurrent + recurrent_bytes) // _STATE_ALIGN) * _STATE_ALIGN
        offsets.append((conv, recurrent))
    return offsets, end


def rows_per_state_slot(
    config: ModelConfig, dtype: torch.dtype, block_size: int, kv_dtype: torch.dtype | None = None
) -> int:
    """Block-sized rows (of a ``kv_dtype`` cache, by default ``dtype``'s) one request's linear-attention
    state takes, for a model running in ``dtype`` (0 for a model without such layers)."""
    if not config.is_hybrid:
        return 0
    block_bytes = block_size * config.kv_bytes_per_token(kv_dtype or dtype)
    return -(-_state_offsets(config, dtype)[1] // block_bytes)


def cache_size_for(model: CausalLM, model_config: ModelConfig, config: RunnerConfig) -> CacheSize:
    """The KV blocks (and state slots) this device holds: fixed by the config, or what the memory
    budget allows."""
    rows_per_slot = rows_per_state_slot(model_config, config.dtype, config.block_size, config.kv_dtype)
    if config.num_blocks:
        return CacheSize(config.num_blocks, config.max_num_seqs if rows_per_slot else 0, rows_per_slot)
    bytes_per_block = config.block_size * model_config.kv_bytes_per_token(config.kv_dtype)
    if config.device.type == "cuda":
        budget = gpu_kv_budget(model, model_config, config)
    else:
        budget = config.kv_cache_memory or cpu_kv_budget(config.tp_size)
    num_slots = 0
    if rows_per_slot:
        per_request = (rows_per_slot + -(-config.max_model_len // config.block_size)) * bytes_per_block
        num_slots = min(config.max_num_seqs, budget // per_request)
        if num_slots < 1:
            raise ValueError(
                f"a budget of {budget} bytes holds no request at max_model_len={config.max_model_len}: one needs "
                f"{per_request} bytes ({rows_per_slot * bytes_per_block} of linear-attention state and the rest KV)"
            )
        budget -= num_slots * rows_per_slot * bytes_per_block
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {bytes_per_block} bytes")
    return CacheSize(int(num_blocks), int(num_slots), rows_per_slot)


def cpu_kv_budget(tp_size: int = 1, limits: CgroupLimits | None = None) -> int:
    """A CPU KV cache's bytes without ``--kv-cache-memory``: ``DEFAULT_CPU_KV_CACHE_BYTES``, or less when the
    cgroup's memory limit leaves less (limit - what it holds now - the margin, this rank's share of it).
    Called once the weights are loaded, so what the cgroup holds counts them (other ranks' too, once loaded)."""
    limits = read_cgroup_limits() if limits is None else limits
    if limits.memory_limit is None or limits.memory_usage is None:
        return DEFAULT_CPU_KV_CACHE_BYTES
    margin = CPU_MEMORY_MARGIN_BYTES + int(limits.memory_limit * CPU_MEMORY_MARGIN_SHARE)
    room = (limits.memory_limit - limits.memory_usage - margin) // tp_size
    gib = 1 << 30
    if room <= 0:
        raise ValueError(
            f"the memory limit ({limits.memory_limit / gib:.2f} GiB, {limits.source}) leaves no room for a KV cache: "
            f"{limits.memory_usage / gib:.2f} GiB in use and {margin / gib:.2f} GiB kept free; raise the limit "
            "or set --kv-cache-memory"
        )
    if room >= DEFAULT_CPU_KV_CACHE_BYTES:
        return DEFAULT_CPU_KV_CACHE_BYTES
    logger.info(
        "KV cache: %.2f GiB, what the memory limit leaves (%.2f GiB, %s; %.2f GiB in use, %.2f GiB kept free)",
        room / gib,
        limits.memory_limit / gib,
        limits.source,
        limits.memory_usage / gib,
        margin / gib,
    )
    return room


def gpu_kv_budget(model: CausalLM, model_config: ModelConfig, config: RunnerConfig) -> int:
    """Memory the KV cache may take: total × utilisation − (weights + activation peak + the CUDA graphs'
    pool)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(config.device)
    weights = torch.cuda.memory_allocated(config.device)  # what the process holds before the profile
    # Profile the largest step the scheduler can issue, with a throwaway cache just big enough.
    tokens = config.max_num_batched_tokens
    num_blocks = -(-tokens // config.block_size)
    rows_per_slot = rows_per_state_slot(model_config, config.dtype, config.block_size, config.kv_dtype)
    scratch_size = CacheSize(num_blocks, 1 if rows_per_slot else 0, rows_per_slot)
    scratch = allocate_kv_cache(model_config, scratch_size.num_rows, config.block_size, config.kv_dtype, config.device)
    states = state_views(model_config, scratch, scratch_size, config.dtype)
    caches = layer_caches(model_config, scratch, states)
    positions = torch.arange(tokens, device=config.device) % config.max_model_len
    metadata = build_attention_metadata([tokens], [tokens], [list(range(num_blocks))], config.block_size, config.device)
    metadata.state_slots = torch.zeros(1, dtype=torch.int64, device=config.device)
    with torch.inference_mode():
        hidden = model(torch.zeros(tokens, dtype=torch.int64, device=config.device), positions, caches, metadata)
        model.compute_logits(hidden[-256:])
    torch.cuda.synchronize(config.device)
    peak = torch.cuda.max_memory_allocated(config.device)
    scratch_bytes = scratch.numel() * scratch.element_size()
    del scratch, caches, hidden
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(config.device).total_memory
    free_now, _ = torch.cuda.mem_get_info(config.device)
    # Memory used outside this process's allocator (other processes, CUDA context) counts too.
    used_elsewhere = (total - free_now) - torch.cuda.memory_reserved(config.device)
    graphs = graph_pool_estimate(peak - scratch_bytes - weights, tokens, graph_sizes(config, model_config))
    return int(total * config.gpu_memory_utilization - (peak - scratch_bytes) - graphs - max(used_elsewhere, 0))


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The whole KV cache, ``[blocks, layers, 2 (K, V), kv_heads, block_size, head_dim]``, zeroed
    (``layers``: those with attention).

        Block-major: one block of every layer is a single contiguous region (one transfer descriptor).
        Head-major inside a block: a head's slab is contiguous, which the CPU decode path gathers.
    """
    num_layers = len(config.attention_layers)
    return allocate_kv_memory(
        (num_blocks, num_layers, 2, config.num_kv_heads, block_size, config.head_dim), dtype, device
    )


def allocate_kv_memory(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for KV blocks. On CPU the memory comes from numpy, which asks Linux for
    transparent huge pages on large arrays (torch does not): a NIXL pull between processes then
    pins and walks 512x fewer pages, and ran 15-25% faster for it (bench/kv_transfer.py). It starts
    on a page boundary."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    spare = np.zeros(num_bytes + _MEMORY_ALIGN, dtype=np.uint8)
    start = -spare.ctypes.data % _MEMORY_ALIGN
    memory = torch.from_numpy(spare[start : start + num_bytes]).view(dtype).view(shape)
    # calloc'd pages are mapped lazily: touch them now, or their first writes page-fault inside the
    # engine's steps (measured 6-9% of decode throughput) instead of once at start-up.
    return memory.zero_()


def layer_views(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) as the kernels address them: ``[blocks, block_size, kv_heads, head_dim]``."""
    return [
        (kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2))
        for layer in range(kv_cache.shape[1])
    ]


def state_views(
    config: ModelConfig, kv_cache: torch.Tensor, size: CacheSize, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each linear layer's state over the slots' rows of ``kv_cache``: the convolution's last inputs
    ``[slots, channels, width - 1]`` in the model's ``dtype`` (whatever the KV cache stores: the state is
    not KV, and its kernel reads the model's dtype), and the recurrent state ``[slots, value_heads,
    key_dim, value_dim]`` in float32 (the gated delta rule accumulates in it)."""
    if not size.num_state_slots:
        return []
    offsets, slot_bytes = _state_offsets(config, dtype)
    rows = kv_cache[size.num_blocks : size.num_rows].view(torch.uint8)
    slots = rows.reshape(size.num_state_slots, -1)[:, :slot_bytes]
    conv_shape = (size.num_state_slots, config.linear_conv_dim, config.linear_conv_kernel_dim - 1)
    recurrent_shape = (
        size.num_state_slots,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    conv_bytes = conv_shape[1] * conv_shape[2] * dtype.itemsize
    recurrent_bytes = recurrent_shape[1] * recurrent_shape[2] * recurrent_shape[3] * 4
    return [
        (
            slots[:, conv : conv + conv_bytes].view(dtype).view(conv_shape),
            slots[:, recurrent : recurrent + recurrent_bytes].view(torch.float32).view(recurrent_shape),
        )
        for conv, recurrent in offsets
    ]


def layer_caches(
    config: ModelConfig, kv_cache: torch.Tensor, state_cache: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What each layer of the model reads and writes, in layer order: an attention layer its (K, V)
    views of the KV cache, a linear-attention layer its (convolution, recurrent) state views
    (``state_views``)."""
    kv_views = iter(layer_views(kv_cache))
    states = iter(state_cache)
    linear = set(config.linear_layers)
    return [next(states) if layer in linear else next(kv_views) for layer in range(config.num_layers)]
