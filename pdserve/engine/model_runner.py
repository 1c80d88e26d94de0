"""ModelRunner: owns the model, the paged KV cache and the sampler; runs one scheduled step.

The KV cache is one block-major tensor (see ``allocate_kv_cache``): each block's KV for every layer
is one contiguous region (what the KV connectors register and move), and each layer's K and V
caches are strided views of it.

Its size comes from a memory budget: on CPU ``kv_cache_memory`` bytes; on GPU the free memory
left at ``gpu_memory_utilization`` after the weights and the peak of a profiling forward pass
(vLLM's determine_available_memory approach).
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.outputs import NO_TOKEN, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pdserve.engine.sampler import Sampler, logprob_entries
from pdserve.kernels.cpu_kernels import cpu_ops
from pdserve.kernels.reference import build_attention_metadata
from pdserve.models.config import ModelConfig
from pdserve.models.loader import load_model

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
# Names the KV cache layout below; engines exchanging blocks must agree on it (KV compatibility hash).
KV_CACHE_LAYOUT = "blocks,layers,kv,heads,block_size,head_dim"


def retain_freed_memory() -> None:
    """Keep freed memory in the process heap (glibc malloc) instead of returning it to the OS.

    Every forward pass allocates and frees activations of several MB. By default glibc serves those
    with fresh mmaps and unmaps them on free, so each op pays page faults on zeroed pages: a 2048-
    token prefill step spent about a fifth of its time there. Raising the mmap and trim thresholds
    (what tcmalloc/jemalloc do by design) makes the memory get reused instead. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 34)
    libc.mallopt(m_top_pad, 64 << 20)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The whole KV cache, ``[blocks, layers, 2 (K, V), kv_heads, block_size, head_dim]``, zeroed.

    Block-major: one block of every layer is a single contiguous region (one transfer descriptor).
    Head-major inside a block: a head's slab is contiguous, which the CPU decode path gathers.
    """
    return allocate_kv_memory((num_blocks, config.num_layers, 2, config.num_kv_heads, block_size, config.head_dim),
                              dtype, device)


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
    return [(kv_cache[:, layer, 0].transpose(1, 2), kv_cache[:, layer, 1].transpose(1, 2))
            for layer in range(kv_cache.shape[1])]


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


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: RunnerConfig) -> None:
        self.model_config = model_config
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        self.model = load_model(Path(config.model), model_config, config.dtype, config.device,
                                max_positions=config.max_model_len)
        self.sampler = Sampler(model_config.vocab_size, config.device)
        if self.device.type == "cpu":
            retain_freed_memory()
            if config.dtype == torch.float32:
                cpu_ops()  # build (or load) the fused CPU kernels now, not inside the first request
        self.num_blocks = config.num_blocks or self._blocks_from_memory()
        self.kv_cache = allocate_kv_cache(model_config, self.num_blocks, self.block_size, config.dtype,
                                          config.device)
        self.layer_caches = layer_views(self.kv_cache)
        # The KV connector's worker side (pdserve.kvtransfer.agent.TransferAgent), when P/D is on.
        self.kv_transfer_agent = None

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.model_config.kv_bytes_per_token(self.config.dtype)

    def _blocks_from_memory(self) -> int:
        if self.device.type == "cuda":
            budget = self._free_gpu_memory_for_kv()
        else:
            budget = self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {self.bytes_per_block} bytes")
        return int(num_blocks)

    def _free_gpu_memory_for_kv(self) -> int:
        """Memory the KV cache may take: total × utilisation − (weights + activation peak)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # Profile the largest step the scheduler can issue, with a throwaway cache just big enough.
        tokens = self.config.max_num_batched_tokens
        num_blocks = -(-tokens // self.block_size)
        config = self.model_config
        scratch = allocate_kv_cache(config, num_blocks, self.block_size, self.config.dtype, self.device)
        caches = layer_views(scratch)
        positions = torch.arange(tokens, device=self.device) % self.config.max_model_len
        metadata = build_attention_metadata([tokens], [tokens], [list(range(num_blocks))], self.block_size,
                                            self.device)
        with torch.inference_mode():
            hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), positions, caches,
                                metadata)
            self.model.compute_logits(hidden[-256:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        scratch_bytes = scratch.numel() * scratch.element_size()
        del scratch, caches, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_now, _ = torch.cuda.mem_get_info(self.device)
        # Memory used outside this process's allocator (other processes, CUDA context) counts too.
        used_elsewhere = (total - free_now) - torch.cuda.memory_reserved(self.device)
        return int(total * self.config.gpu_memory_utilization - (peak - scratch_bytes) - max(used_elsewhere, 0))

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.finished_req_ids:
            self.sampler.forget(scheduler_output.finished_req_ids)
        agent = self.kv_transfer_agent
        if agent is not None and scheduler_output.kv_connector_metadata is not None:
            agent.submit(scheduler_output.kv_connector_metadata)
        requests = scheduler_output.requests
        if not requests:
            return ModelRunnerOutput([], kv_connector_output=agent.collect() if agent is not None else None)

        input_ids: list[int] = []
        positions: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []  # batch token index whose logits give each sampled request's token
        sample_requests = []
        prompt_rows: list[tuple[int, int, int, int]] = []  # (request index, first row, first position, count)
        row = 0
        for index, (request, num_new, start) in enumerate(zip(
                requests, scheduler_output.num_scheduled_tokens, scheduler_output.start_positions, strict=True)):
            end = start + num_new
            if num_new == 1:
                input_ids.append(request.all_token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(request.all_token_ids[start:end])
                positions.extend(range(start, end))
            context_lens.append(end)
            if end == request.num_tokens:
                sample_rows.append(row + num_new - 1)
                sample_requests.append(index)
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                count = min(end, request.num_prompt_tokens - 1) - start
                prompt_rows.append((index, row, start, count))
            row += num_new

        device = self.device
        metadata = build_attention_metadata(scheduler_output.num_scheduled_tokens, context_lens,
                                            scheduler_output.block_ids, self.block_size, device)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=device),
                            torch.tensor(positions, dtype=torch.int64, device=device),
                            self.layer_caches, metadata)

        sampled = [NO_TOKEN] * len(requests)
        logprobs: list[TokenLogprobs | None] | None = None
        if sample_rows:
            logits = self.model.compute_logits(hidden[sample_rows]).float()
            token_ids, row_logprobs = self.sampler.sample(logits, [requests[i] for i in sample_requests])
            for index, token_id in zip(sample_requests, token_ids, strict=True):
                sampled[index] = token_id
            if row_logprobs is not None:
                logprobs = [None] * len(requests)
                for index, entry in zip(sample_requests, row_logprobs, strict=True):
                    logprobs[index] = entry
        prompt_logprobs = self._prompt_logprobs(hidden, requests, prompt_rows) if prompt_rows else None
        return ModelRunnerOutput(sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                 kv_connector_output=agent.collect() if agent is not None else None)

    def close(self) -> None:
        if self.kv_transfer_agent is not None:
            self.kv_transfer_agent.close()

    def _prompt_logprobs(self, hidden: torch.Tensor, requests: list, prompt_rows: list[tuple[int, int, int, int]]
                         ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        result = {}
        for index, first_row, first_position, count in prompt_rows:
            request = requests[index]
            logits = self.model.compute_logits(hidden[first_row:first_row + count]).float()
            targets = request.prompt_token_ids[first_position + 1:first_position + 1 + count]
            entries = logprob_entries(torch.log_softmax(logits, dim=-1), targets,
                                      [request.sampling_params.prompt_logprobs] * count)
            result[request.request_id] = (first_position, entries)
        return result

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens ({tokens} tokens, "
                f"{self.num_blocks * self.bytes_per_block / 2**30:.2f} GiB {str(self.config.dtype)[6:]}); "
                f"max concurrency at {self.config.max_model_len} tokens per request: "
                f"{tokens / self.config.max_model_len:.1f}x")
