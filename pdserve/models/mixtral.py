"""The Mixtral family (MixtralForCausalLM): Mistral's attention (``models/llama.py``), and routed
experts in every layer in place of the MLP, each of config.json's intermediate_size, the router's
weights renormalised over the chosen experts; the layer's experts named ``block_sparse_moe``."""

from __future__ import annotations

from typing import Any

from pdserve.models.family import ATTENTION_PROJECTIONS, Checkpoint, Experts, Family, Layers, routed_layers


def _layers(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    return routed_layers(
        raw, int(raw["num_local_experts"]), tuple(range(num_layers)), int(raw["intermediate_size"]), True
    )


FAMILY = Family(
    "mixtral",
    Layers(sliding_window_by_default=True, read_layers=_layers),
    Checkpoint(
        packed=ATTENTION_PROJECTIONS,
        renamed={"block_sparse_moe.gate.weight": "mlp.gate_weight_t"},
        experts=Experts("block_sparse_moe.experts", {"w1": "gate", "w3": "up", "w2": "down"}),
    ),
)
