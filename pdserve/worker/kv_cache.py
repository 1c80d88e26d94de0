"""The KV-cache tensors of one device: their layout, their size from a memory budget, their allocation.

The KV cache is one block-major tensor (see ``allocate_kv_cache``): each block's KV for every layer
is one contiguous region (what the KV connectors register and move), and each layer's K and V
caches are strided views of it. Its size comes from a memory budget: on CPU ``kv_cache_memory``
bytes; on GPU the free memory left at ``gpu_memory_utilization`` after the weights and the peak of
a profiling forward pass (vLLM's determine_available_memory approach).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.reference import build_attention_metadata
from pdserve.models.config import ModelConfig
from pdserve.models.transformer import CausalLM

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
# Names the KV cache layout below; engines exchanging blocks must agree on it (KV compatibility hash).
KV_CACHE_LAYOUT = "blocks,layers,kv,heads,block_size,head_dim"


@dataclass
class RunnerConfig:
    model: str
    dtype: torch.dtype
    device: torch.device
    block_size: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes (CPU); None: DEFAULT_CPU_KV_CACHE_BYTES
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # fixes the block count, overriding the memory budget
    # Tensor parallelism: this runner is rank ``tp_rank`` of ``tp_size`` (the budget above is per rank).
    tp_rank: int = 0
    tp_size: int = 1


def num_blocks_for(model: CausalLM, model_config: ModelConfig, config: RunnerConfig) -> int:
    """How many KV blocks this device holds: fixed by the config, or what the memory budget allows."""
    if config.num_blocks:
        return config.num_blocks
    bytes_per_block = config.block_size * model_config.kv_bytes_per_token(config.dtype)
    if config.device.type == "cuda":
        budget = gpu_kv_budget(model, model_config, config)
    else:
        budget = config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {bytes_per_block} bytes")
    return int(num_blocks)


def gpu_kv_budget(model: CausalLM, model_config: ModelConfig, config: RunnerConfig) -> int:
    """Memory the KV cache may take: total × utilisation − (weights + activation peak)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(config.device)
    # Profile the largest step the scheduler can issue, with a throwaway cache just big enough.
    tokens = config.max_num_batched_tokens
    num_blocks = -(-tokens // config.block_size)
    scratch = allocate_kv_cache(model_config, num_blocks, config.block_size, config.dtype, config.device)
    caches = layer_views(scratch)
    positions = torch.arange(tokens, device=config.device) % config.max_model_len
    metadata = build_attention_metadata([tokens], [tokens], [list(range(num_blocks))], config.block_size, config.device)
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
    return int(total * config.gpu_memory_utilization - (peak - scratch_bytes) - max(used_elsewhere, 0))


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The whole KV cache, ``[blocks, layers, 2 (K, V), kv_heads, block_size, head_dim]``, zeroed.

    Block-major: one block of every layer is a single contiguous region (one transfer descriptor).
    Head-major inside a block: a head's slab is contiguous, which the CPU decode path gathers.
    """
    return allocate_kv_memory(
        (num_blocks, config.num_layers, 2, config.num_kv_heads, block_size, config.head_dim), dtype, device
    )


def allocate_kv_memory(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for KV blocks. On CPU the memory comes from numpy, which asks Linux for
    transparent huge pages on large arrays (torch does not): a NIXL pull between processes then
    pins and walks 512x fewer pages, and ran 15-25% faster for it (bench/kv_transfer.py)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory = torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
    # calloc'd pages are mapped lazily: touch them now, or their first writes page-fault inside the
    # engine's steps (measured 6-9% of decode throughput) instead of once at start-up.
    return memory.zero_()


def layer_views(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) as the kernels address them: ``[blocks, block_size, kv_heads, head_dim]``."""
    return [
        (kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2))
        for layer in range(kv_cache.shape[1])
    ]
