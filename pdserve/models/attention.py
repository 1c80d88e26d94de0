"""Which attention implementation a device uses: Triton kernels on CUDA, torch reference on CPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kernels import reference
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
    return AttentionBackend("torch", reference.write_kv, reference.paged_attention)


__all__ = ["AttentionBackend", "AttentionMetadata", "attention_backend"]
