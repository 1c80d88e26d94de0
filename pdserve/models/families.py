"""The model-family registry: which family (``models/<family>.py``, a ``Family`` declaration) serves
each Hugging Face architecture a ``config.json`` names, and which families the demo-model writer
(``models/demo.py``) can write. Adding a family is its module and one row here.

No torch: the API process and the CLI read it.
"""

from __future__ import annotations

from typing import Any

from pdserve.models import llama, mixtral, qwen2, qwen3, qwen3_5, qwen3_moe
from pdserve.models.family import Family, UnsupportedModelError

# One row per family: the architectures (config.json's "architectures") it serves -> its declaration.
FAMILIES: dict[tuple[str, ...], Family] = {
    ("LlamaForCausalLM", "MistralForCausalLM"): llama.FAMILY,
    ("MixtralForCausalLM",): mixtral.FAMILY,
    ("Qwen2ForCausalLM",): qwen2.FAMILY,
    ("Qwen3ForCausalLM",): qwen3.FAMILY,
    ("Qwen3MoeForCausalLM",): qwen3_moe.FAMILY,
    (
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    ): qwen3_5.FAMILY,
}
ARCHITECTURES: dict[str, Family] = {name: family for names, family in FAMILIES.items() for name in names}

# The families `pdserve demo-model --family` writes, at the demo model's scale: config.json's
# architecture and model_type, and what the family adds to the demo's shape (models/demo.py).
DEMO_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {}),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192, "norm_topk_prob": True},
    ),
    "qwen3.5": (
        "Qwen3_5ForCausalLM",
        "qwen3_5_text",
        {
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    ),
}


def supported_architecture(architectures: list[str], model_type: str | None = None) -> str:
    """The first of a config.json's ``architectures`` that a family serves."""
    found = next((name for name in architectures if name in ARCHITECTURES), None)
    if found is None:
        raise UnsupportedModelError(
            f"unsupported model architecture {architectures or model_type!r}; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return found
