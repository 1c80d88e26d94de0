"""The Qwen3-MoE family (Qwen3MoeForCausalLM): Qwen3's attention (``models/qwen3.py``), and in
place of the MLP routed experts on every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``;
the router's weights renormalised over the chosen experts if ``norm_topk_prob``."""

from __future__ import annotations

from typing import Any

from pdserve.models.family import DENSE_PROJECTIONS, Checkpoint, Experts, Family, Layers, routed_layers

# Qwen's names for a routed layer's router and experts (Qwen3.5-MoE keeps them).
ROUTER = {"mlp.gate.weight": "mlp.gate_weight_t"}
EXPERTS = Experts("mlp.experts", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})


def _layers(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    # transformers 5 writes num_local_experts where Qwen's own configs say num_experts.
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step", 1))
    dense = {int(layer) for layer in raw.get("mlp_only_layers") or []}
    moe_layers = tuple(
        layer for layer in range(num_layers) if num_experts and layer not in dense and (layer + 1) % step == 0
    )
    inter = int(raw.get("moe_intermediate_size", 0))
    return routed_layers(raw, num_experts, moe_layers, inter, bool(raw.get("norm_topk_prob", False)))


FAMILY = Family(
    "qwen3-moe",
    Layers(qk_norm=True, read_layers=_layers),
    # Dense layers (mlp_only_layers) keep the MLP's names.
    Checkpoint(packed=DENSE_PROJECTIONS, renamed=ROUTER, experts=EXPERTS),
)
