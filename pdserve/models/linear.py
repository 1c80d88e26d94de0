"""The linear layers models are built from: weights stored transposed for CPU speed, and the
row-parallel variant whose partial outputs are summed over tensor-parallel ranks."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.models.parallel import TensorParallel


class Linear(nn.Module):
    """``x @ W.T + b`` with W stored transposed, ``[in_features, out_features]``: on CPU the skinny
    matmuls of decode batches run about 20% faster from this layout (docs/benchmarks.md)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the ranks: each multiplies its share, the
    partial outputs are summed, then the (whole) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = self.tp.all_reduce(torch.mm(x, self.weight_t))
        return out if self.bias is None else out.add_(self.bias)
