"""The Llama family (LlamaForCausalLM), and Mistral, Llama's layout with a sliding window: attention
without q/k norms, biased or not as config.json's attention_bias says, rotary over whole heads, a
SwiGLU MLP, the LM head tied to the embedding or not; tensors under Llama's names."""

from __future__ import annotations

from pdserve.models.family import DENSE_PROJECTIONS, Checkpoint, Family, Layers

# Mistral's sliding_window applies whenever set (its configs have no use_sliding_window); Llama's set none.
FAMILY = Family("llama", Layers(sliding_window_by_default=True), Checkpoint(packed=DENSE_PROJECTIONS))
