"""Which attention implementation a device uses: Triton kernels on CUDA; on CPU the torch
reference with decodes in the fused C++ kernel (built on first use, reference fallback)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kernels import cpu_kernels, reference
from pdserve.kernels.reference import AttentionMetadata


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def attention_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from pdserve.kernels import triton_attention  # imports triton: only where it can compile

        return AttentionBackend("triton", triton_attention.write_kv, triton_attention.paged_attention)
    return AttentionBackend("cpu", reference.write_kv, cpu_kernels.paged_attention)


__all__ = ["AttentionBackend", "AttentionMetadata", "attention_backend"]
