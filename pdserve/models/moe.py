"""A routed MLP layer (mixture of experts): the router, the experts' stacked weights, and the choice
of expert kernel by device (Triton on CUDA, the grouped torch path on CPU); for Qwen3.5-MoE also a
shared expert every token goes through, scaled by a sigmoid gate of the token.

Under tensor parallelism every rank holds every expert, with its share of each expert's
intermediate features (as the dense MLP is split); the router is replicated, so all ranks choose
the same experts, and one all-reduce sums the partial outputs. Expert parallelism (experts placed
whole on different ranks) is not built.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels import cpu_kernels, moe
from pdserve.kernels.activation import swiglu
from pdserve.models.config import ModelConfig
from pdserve.models.linear import Linear
from pdserve.models.parallel import TensorParallel


class SharedExpert(nn.Module):
    """The MLP every token of a routed layer also goes through; its output is scaled by
    ``sigmoid(x @ gate)`` and added to the experts'. Its down projection's partial sums (under
    tensor parallelism) join the experts' before the block's one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.gate_weight_t = nn.Parameter(torch.empty(hidden_size, 1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(swiglu(self.gate_up_proj(hidden)))
        return out.mul_(torch.sigmoid(torch.mm(hidden, self.gate_weight_t)))


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        # The router's matrix, [hidden, experts]: stored transposed, as Linear stores its weight.
        self.gate_weight_t = nn.Parameter(torch.empty(config.hidden_size, config.num_experts))
        inter = config.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, 2 * inter))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, inter, config.hidden_size))
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        shared = config.shared_expert_intermediate_size
        self.shared_expert = SharedExpert(config.hidden_size, shared) if shared else None
        self.tp = tp

    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        """Repack every expert's weights for the CPU kernel; ``w13`` and ``w2`` then hold the panels
        (``moe.grouped_experts`` takes either layout)."""
        self.w13 = nn.Parameter(torch.stack([cpu_kernels.pack_weight(w) for w in self.w13]), requires_grad=False)
        self.w2 = nn.Parameter(torch.stack([cpu_kernels.pack_weight(w) for w in self.w2]), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.select_experts(torch.mm(hidden, self.gate_weight_t), self.top_k, self.renormalize)
        if hidden.is_cuda:
            from pdserve.kernels import triton_moe  # imports triton: only where it is used

            out = triton_moe.fused_experts(hidden, self.w13, self.w2, weights, ids)
        else:
            out = moe.grouped_experts(hidden, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden)
        return self.tp.all_reduce(out)
