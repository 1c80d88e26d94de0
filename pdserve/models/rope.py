"""Rotary position embeddings: frequencies for the supported rope types, a cos/sin table, and
their application (the "rotate half" layout of Llama, Qwen2 and Qwen3 checkpoints).

Frequencies are computed as transformers computes them, in float32, so positions embed
bit-for-bit alike and greedy outputs can match Hugging Face exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        original_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = original_len / low_freq_factor
        high_freq_wavelen = original_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by the factor, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


class RotaryEmbedding:
    """cos/sin tables for every position, computed in float32 and stored in the model's dtype.

    Plain tensors, not module buffers: models are built on the meta device and materialised
    empty, which must not wipe these tables.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = angles.cos().to(dtype=dtype, device=device)
        self.sin = angles.sin().to(dtype=dtype, device=device)

    def for_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows of a batch's positions, shaped to broadcast over heads; looked up once per
        forward pass and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [tokens, heads, head_dim]`` (any strides) by its tokens' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:].neg(), x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, rotated, sin)
