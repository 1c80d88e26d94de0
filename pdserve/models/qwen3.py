"""The Qwen3 family (Qwen3ForCausalLM): Llama's layout (``models/llama.py``) with each q and k head
normalised (RMSNorm, ``self_attn.q_norm`` and ``k_norm``) before rotary."""

from __future__ import annotations

from pdserve.models.family import DENSE_PROJECTIONS, Checkpoint, Family, Layers

FAMILY = Family("qwen3", Layers(qk_norm=True), Checkpoint(packed=DENSE_PROJECTIONS))
