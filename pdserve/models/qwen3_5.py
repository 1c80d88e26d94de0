"""The Qwen3.5 family (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, and their vision-language classes
served text-only): hybrid layers, named by ``layer_types``, whose token mixer is either Gated DeltaNet
linear attention (``models/gated_deltanet.py``, a fixed-size state per request) or Qwen3's attention
(``models/qwen3.py``) with its output gated by a second query-sized projection and rotary over a
quarter of each head. The MoE variant routes every layer's tokens to experts, renormalised, beside a
shared expert every token goes through, scaled by a sigmoid gate of the token.

Checkpoints store the RMSNorm weights of the decoder as offsets from 1, the linear attention's four
input projections apart (fused here into one), and a vision-language class's text model under
``model.language_model``, beside a vision tower and a multi-token-prediction head not run here.
"""

from __future__ import annotations

from typing import Any

from pdserve.models.family import (
    DENSE_PROJECTIONS,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    Checkpoint,
    Family,
    Layers,
    UnsupportedModelError,
    routed_layers,
)
from pdserve.models.qwen3_moe import EXPERTS, ROUTER


def _layers(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = int(raw.get("full_attention_interval", 4))
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedModelError(
            f"layer_types must name {num_layers} layers, each {FULL_ATTENTION} or {LINEAR_ATTENTION}; got {layer_types}"
        )
    if FULL_ATTENTION not in layer_types:
        raise UnsupportedModelError("a hybrid model without full-attention layers is not supported")
    fields = {
        "linear_num_key_heads": int(raw.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(raw.get("linear_num_value_heads", 32)),
        "linear_key_head_dim": int(raw.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(raw.get("linear_value_head_dim", 128)),
        "linear_conv_kernel_dim": int(raw.get("linear_conv_kernel_dim", 4)),
    }
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise UnsupportedModelError(
            f"{fields['linear_num_value_heads']} linear-attention value heads do not share "
            f"{fields['linear_num_key_heads']} key heads evenly"
        )
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)  # the MoE variant's
    experts = routed_layers(
        raw,
        num_experts,
        tuple(range(num_layers)) if num_experts else (),
        int(raw.get("moe_intermediate_size", 0)),
        True,
        int(raw.get("shared_expert_intermediate_size", 0)),
    )
    return {
        "layer_types": tuple(layer_types),
        "attn_output_gate": bool(raw.get("attn_output_gate", True)),
        **fields,
        **experts,
    }


FAMILY = Family(
    "qwen3.5",
    Layers(qk_norm=True, partial_rotary_factor=0.25, read_layers=_layers),
    Checkpoint(
        packed={
            **DENSE_PROJECTIONS,
            "linear_attn.in_proj_qkv": ("linear_attn.in_proj", "qkv"),
            "linear_attn.in_proj_z": ("linear_attn.in_proj", "z"),
            "linear_attn.in_proj_b": ("linear_attn.in_proj", "b"),
            "linear_attn.in_proj_a": ("linear_attn.in_proj", "a"),
            "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate"),
            "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", "up"),
        },
        renamed={
            **ROUTER,
            "mlp.shared_expert_gate.weight": "mlp.shared_expert.gate_weight_t",
            "linear_attn.conv1d.weight": "linear_attn.conv1d_weight",
        },
        experts=EXPERTS,
        prefixes={"model.language_model.": "model."},
        skipped={"model.visual.": "the vision tower", "mtp.": "multi-token prediction"},
        offset_norms=(
            "model.norm.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
        ),
    ),
)
