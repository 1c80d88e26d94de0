"""The Qwen2 family (Qwen2ForCausalLM): Llama's layout (``models/llama.py``) with biases on the q, k
and v projections, whatever attention_bias says, and none on the output projection."""

from __future__ import annotations

from pdserve.models.family import DENSE_PROJECTIONS, Checkpoint, Family, Layers

FAMILY = Family("qwen2", Layers(qkv_bias_only=True), Checkpoint(packed=DENSE_PROJECTIONS))
