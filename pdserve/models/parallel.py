"""Tensor parallelism: which slice of the model one rank holds, and the collectives that join them.

Megatron's split, as vLLM does it: q/k/v and gate/up are column-parallel (each rank computes its
own heads and its own share of the intermediate features), o and down are row-parallel (each rank
multiplies its share of the inputs; an all-reduce sums the partial outputs), the embedding and the
LM head are vocabulary-parallel (a rank holds a contiguous range of rows; the lookup is masked and
all-reduced, the logits all-gathered). Each expert of a mixture-of-experts layer is split as the
dense MLP is (its intermediate features). KV heads are split across ranks, or replicated when there
are fewer KV heads than ranks (each rank then holds the one KV head its query heads read).

``TensorParallel()`` is one rank alone: every collective is a no-op, and the model computes
exactly as it would without this module. The collectives use the default ``torch.distributed``
process group (gloo on CPU, NCCL on CUDA), set up by the worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.models.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(tensor)
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's ``[rows, widths[rank]]`` block, side by side (ranks may differ in width)."""
        if self.size == 1:
            return tensor
        widest = max(widths)
        padded = torch.nn.functional.pad(tensor, (0, widest - tensor.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        torch.distributed.all_gather(parts, padded)
        return torch.cat([part[:, :width] for part, width in zip(parts, widths, strict=True)], dim=1)

    def even_range(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of ``total`` items split evenly (``total`` divides by the size)."""
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    def vocab_ranges(self, vocab_size: int) -> list[tuple[int, int]]:
        """Every rank's [start, end) of the vocabulary: equal shares, the last one shorter."""
        share = -(-vocab_size // self.size)
        return [(min(r * share, vocab_size), min((r + 1) * share, vocab_size)) for r in range(self.size)]

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads this rank holds: its even share, or (fewer heads than ranks) the one head
        that its query heads read, replicated on ``size / num_kv_heads`` ranks."""
        if num_kv_heads >= self.size:
            return self.even_range(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return head, head + 1


def split_problem(config: ModelConfig, size: int) -> str | None:
    """Why a model cannot be split over ``size`` ranks, or None."""
    num_heads, num_kv_heads, intermediate_size = config.num_heads, config.num_kv_heads, config.intermediate_size
    if size < 1:
        return f"the tensor-parallel size must be at least 1, got {size}"
    if num_heads % size:
        return f"{num_heads} attention heads do not split over {size} ranks"
    if num_kv_heads % size and size % num_kv_heads:
        return f"{num_kv_heads} KV heads neither split over {size} ranks nor replicate evenly on them"
    if intermediate_size % size:
        return f"an intermediate size of {intermediate_size} does not split over {size} ranks"
    for count, what in (
        (config.linear_num_key_heads, "linear-attention key heads"),
        (config.linear_num_value_heads, "linear-attention value heads"),
        (config.shared_expert_intermediate_size, "a shared expert's intermediate features"),
    ):
        if count % size:
            return f"{count} {what} do not split over {size} ranks"
    if config.num_experts and config.moe_intermediate_size % size:
        return f"an expert intermediate size of {config.moe_intermediate_size} does not split over {size} ranks"
    return None


def rank_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The model as one rank holds it: its own attention heads, KV heads and intermediate features
    (dense, per expert and of a shared expert), and its linear-attention key and value heads (the
    vocabulary stays whole: the embedding and LM head split it themselves)."""
    if tp.size == 1:
        return config
    kv_start, kv_end = tp.kv_head_range(config.num_kv_heads)
    return replace(
        config,
        num_heads=config.num_heads // tp.size,
        num_kv_heads=kv_end - kv_start,
        intermediate_size=config.intermediate_size // tp.size,
        moe_intermediate_size=config.moe_intermediate_size // tp.size,
        linear_num_key_heads=config.linear_num_key_heads // tp.size,
        linear_num_value_heads=config.linear_num_value_heads // tp.size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // tp.size,
    )
