"""The linear layers models are built from: weights stored transposed for CPU speed (or, once
packed, in the CPU kernel's panels), and the row-parallel variant whose partial outputs are summed
over tensor-parallel ranks."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels import cpu_kernels
from pdserve.models.parallel import TensorParallel


class Linear(nn.Module):
    """``x @ W.T + b``. W is loaded transposed, ``[in_features, out_features]`` (MKL's skinny
    matmuls run about 20% faster from that layout than from ``[out, in]``); on a CPU running fp32,
    ``pack_for_cpu`` then moves it into the packed kernel's panels, faster again at every batch
    size (docs/benchmarks.md)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("packed", None, persistent=False)

    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        """Repack W for ``cpu_kernels.packed_linear``; the ``[in, out]`` copy is dropped."""
        self.packed = cpu_kernels.pack_weight(self.weight_t)
        del self.weight_t

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T``, without the bias."""
        if self.packed is not None:
            return cpu_kernels.packed_linear(x, self.packed, self.out_features)
        return torch.mm(x, self.weight_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        return out if self.bias is None else out.add_(self.bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the ranks: each multiplies its share, the
    partial outputs are summed, then the (whole) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)
