"""Which attention implementation a device uses: Triton kernels on CUDA; on CPU the torch
reference with the fused C++ ops (decodes, rotary + KV write) where they could be built. Chosen once,
when the loader builds the model (``attention_backend``); each step's layers call the backend's ops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kernels import cpu_kernels, reference
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.models.rope import apply_rotary


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (qk, v, cos, sin, k_cache, v_cache, metadata, kv_scales): rotate the q and k heads of qk [tokens,
    # q_heads + kv_heads, head_dim] in place, then store the k heads and v in their cache slots.
    rotate_and_cache: Callable[..., None]
    # (q, k_cache, v_cache, metadata, scale, kv_scales): ``reference.paged_attention``'s contract.
    paged_attention: Callable[..., torch.Tensor]
    # (key, value, k_cache, v_cache, metadata, kv_scales): store already-rotated k heads and v (partial
    # rotary, where the rotation is the model's own). ``kv_scales``: an 8-bit cache's (k, v) scales.
    write_kv: Callable[..., None]


def rotate_and_cache_with(
    write_kv: Callable[..., None], fused: Callable[..., bool] | None = None
) -> Callable[..., None]:
    """A backend's rotate_and_cache from its write_kv, trying a fused kernel first if given (it
    returns False when it does not apply)."""

    def rotate_and_cache(
        qk: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: tuple[float, float] = reference.NO_SCALES,
    ) -> None:
        if fused is not None and fused(qk, value, cos, sin, k_cache, v_cache, metadata, kv_scales):
            return
        qk.copy_(apply_rotary(qk, cos, sin))
        write_kv(qk[:, qk.shape[1] - value.shape[1] :], value, k_cache, v_cache, metadata, kv_scales)

    return rotate_and_cache


def triton_backend() -> AttentionBackend:
    from pdserve.kernels import triton_attention  # imports triton: only where it is used

    return AttentionBackend(
        "triton",
        rotate_and_cache_with(triton_attention.write_kv),
        triton_attention.paged_attention,
        triton_attention.write_kv,
    )


def attention_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        return triton_backend()
    return AttentionBackend(
        "cpu",
        rotate_and_cache_with(reference.write_kv, cpu_kernels.rope_write_kv),
        cpu_kernels.paged_attention,
        reference.write_kv,
    )


__all__ = ["AttentionBackend", "AttentionMetadata", "attention_backend"]
