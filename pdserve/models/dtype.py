"""The dtype a model runs in, from ``--dtype``, and the dtype its KV cache holds, from
``--kv-cache-dtype``. Apart from ``models/config.py``, which must not import torch (the API process
reads configs)."""

from __future__ import annotations

import torch

from pdserve.models.config import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``--dtype``: "auto" (or None) is float32 on CPU (bf16 matmuls are very slow there) and
    bfloat16 on GPU; otherwise a torch dtype name such as "float16"."""
    if name in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    aliases = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return dtype


def resolve_kv_cache_dtype(name: str | None, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``--kv-cache-dtype``: "auto" (or None) stores KV in the model's dtype; bfloat16 and float16 halve
    an fp32 cache (the kernels read them back into float32); fp8_e4m3 (float8_e4m3fn, K and V divided by a
    scale per layer) halves a 16-bit one. ``device`` is where the cache lives (a CPU reads fp8 KV through
    the torch reference path only: ``engine.build`` says so at start)."""
    key = KV_CACHE_DTYPE_ALIASES.get(name or "auto", name or "auto")
    if key == "auto":
        return model_dtype
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; use {', '.join(KV_CACHE_DTYPES)}")
    if key == "fp8_e4m3":
        return torch.float8_e4m3fn
    return getattr(torch, key)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
