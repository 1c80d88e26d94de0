"""The dtype a model runs in, from ``--dtype``. Apart from ``models/config.py``, which must not
import torch (the API process reads configs)."""

from __future__ import annotations

import torch


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
