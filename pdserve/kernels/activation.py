"""The SwiGLU activation between an MLP's two projections (dense MLPs, experts, shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_kernels


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, the two halves of the last dimension (one fused pass on a CPU, in fp32)."""
    fused = cpu_kernels.silu_mul(gate_up)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
