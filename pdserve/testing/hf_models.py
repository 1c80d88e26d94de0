"""Tiny seeded Hugging Face models in several shapes (transformers is the test oracle).

Shared by the model tests and bench/gpu_check.py, which builds the same models on the GPU machine
(so no pytest here); transformers is imported only when a model is built.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

VOCAB = 1024  # the demo tokenizer's size, so every model can share it

# Llama 3's RoPE scaling at a small original context. Give transformers a copy: it adds rope_theta to the dict.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2}

# name -> (transformers classes, config overrides). initializer_range 0.2 makes logits peaked, so
# fp32 summation-order differences cannot flip a near-tie.
SHAPES = {
    "llama-mha-untied": ("Llama", {"num_attention_heads": 4, "num_key_value_heads": 4}),
    "llama-gqa4-tied-llama3rope": (
        "Llama",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_scaling": dict(LLAMA3_ROPE),
        },
    ),
    # Llama's optional biases: on q, k, v and o (attention_bias) and on the MLP's three projections (mlp_bias).
    "llama-gqa2-biases": ("Llama", {**_ATTENTION, "attention_bias": True, "mlp_bias": True}),
    "qwen2-gqa2-bias": ("Qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3-gqa2-headdim": (
        "Qwen3",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": True},
    ),
    "qwen3-linear-rope": (
        "Qwen3",
        {"num_attention_heads": 4, "num_key_value_heads": 1, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    # Mixture of experts: top-1, 2 and 4 of 4 to 16 experts, renormalised or not, dense layers among routed ones.
    "qwen3moe-e4-top1": (
        "Qwen3Moe",
        {**_ATTENTION, "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 48, "norm_topk_prob": True},
    ),
    "qwen3moe-e8-top2-mlponly": (
        "Qwen3Moe",
        {**_ATTENTION, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 40, "mlp_only_layers": [1]},
    ),
    "qwen3moe-e16-top4-step2": (
        "Qwen3Moe",
        {
            **_ATTENTION,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
        },
    ),
    "mixtral-e4-top2": ("Mixtral", {**_ATTENTION, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # Hybrid (Qwen3.5): Gated DeltaNet layers with one gated full-attention layer in four (or two), rotary over
    # a quarter (or half) of each head, convolutions of width 4 (or 2), key heads shared by 2 or 3 value heads;
    # as a causal LM, with routed and shared experts, and as the vision-language class served text-only.
    "qwen3.5-hybrid": (
        "Qwen3_5",
        {
            **_ATTENTION,
            "num_hidden_layers": 4,
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 24,
        },
    ),
    "qwen3.5-interval2-conv2": (
        "Qwen3_5",
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "head_dim": 24,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "linear_conv_kernel_dim": 2,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 3,
            "linear_key_head_dim": 24,
            "linear_value_head_dim": 8,
        },
    ),
    "qwen3.5-moe-e8-top2-shared": (
        "Qwen3_5Moe",
        {
            **_ATTENTION,
            "layer_types": ["linear_attention", "full_attention"],
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    "qwen3.5-vl-text": (
        "Qwen3_5Vl",
        {
            **_ATTENTION,
            "layer_types": ["linear_attention", "full_attention"],
            "head_dim": 16,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "tie_word_embeddings": True,
        },
    ),
}


def build_hf_model(family: str, overrides: dict, path) -> Any:
    """A tiny seeded ``family`` model (Llama, Qwen2, Qwen3, Qwen3Moe, Mixtral, Qwen3_5; Qwen3_5Vl: the
    vision-language class with a tiny vision tower) saved to ``path``: the transformers model, whose
    ``generate`` runs the text. (Mixtral's experts take ``intermediate_size``.)"""
    import transformers

    fields = {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-6,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
        "vocab_size": VOCAB,  # a smaller vocabulary still works with the demo tokenizer's ids
        **overrides,
    }
    torch.manual_seed(zlib.crc32(family.encode()))  # not hash(): it changes per process
    if family == "Qwen3_5Vl":
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
        tied = fields.pop("tie_word_embeddings", False)
        config = transformers.Qwen3_5Config(text_config=fields, vision_config=vision, tie_word_embeddings=tied)
        model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    elif family in ("Qwen3_5", "Qwen3_5Moe"):
        config = getattr(transformers, f"{family}TextConfig")(**fields)
        model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    else:
        config = getattr(transformers, f"{family}Config")(**fields)
        model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        if family in (
            "Llama",
            "Qwen2",
        ):  # biases (Qwen2's q/k/v, Llama's optional ones) start at zero: make them matter
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0, 0.2)
        if family.startswith("Qwen3_5"):  # norm weights start at 0 (offsets from 1) or 1: make them matter
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.2)
                if name.endswith("mlp.gate.weight"):  # the router starts at zero: every expert tied
                    param.normal_(0, 0.2)
    model.save_pretrained(str(path))
    return model


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens for one prompt, and its log-softmax (float32) at each generated position."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([prompt], device=device)
        # An explicit mask: without one, generate treats every pad-id token in the prompt as padding.
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :].float()
    return out[0, len(prompt) :].tolist(), torch.log_softmax(logits, dim=-1).cpu()


def first_divergence(ours: list[int], expected: list[int], hf_logprobs: torch.Tensor) -> tuple[int, float] | None:
    """(position, HF's top-2 logprob margin there) of the first differing token, or None."""
    for position, (a, b) in enumerate(zip(ours, expected, strict=True)):
        if a != b:
            top2 = hf_logprobs[position].topk(2).values
            return position, float(top2[0] - top2[1])
    return None
