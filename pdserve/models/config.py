"""ModelConfig: what pdserve needs from a Hugging Face model folder's ``config.json``.

Reads both config dialects: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). Mixture-of-experts models (Qwen3-MoE, Mixtral) are the dense layout with
routed experts in place of some layers' MLP: which layers, how many experts, how many per token.
Hybrid models (Qwen3.5, and Qwen3.5-MoE with routed experts and a gated shared expert in every
layer) mix two token mixers, named per layer by ``layer_types``: gated full
attention (on the paged KV cache) and Gated DeltaNet linear attention (a fixed-size state per
request); a Qwen3.5 checkpoint of the vision-language class is read for its text model.
Unsupported architectures and features fail here, with a clear error, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Architecture name → the family's attention features. Mistral is Llama's layout, Mixtral Mistral's
# with experts, Qwen3-MoE Qwen3's with experts.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias_only": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias_only": False, "qk_norm": False},
    "MixtralForCausalLM": {"qkv_bias_only": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias_only": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias_only": False, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"qkv_bias_only": False, "qk_norm": True},
    "Qwen3_5ForCausalLM": {"qkv_bias_only": False, "qk_norm": True},
    "Qwen3_5ForConditionalGeneration": {"qkv_bias_only": False, "qk_norm": True},
    "Qwen3_5MoeForCausalLM": {"qkv_bias_only": False, "qk_norm": True},
    "Qwen3_5MoeForConditionalGeneration": {"qkv_bias_only": False, "qk_norm": True},
}
# Hybrid architectures: linear-attention layers beside gated full attention, RMSNorm weights stored
# as offsets from 1 (the loader adds the 1), rotary over part of each head.
_HYBRID = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
# Vision-language classes, served text-only: their config.json nests the text model's under text_config.
_VISION_LANGUAGE = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
# Architectures whose sliding_window, when set, applies without a use_sliding_window flag.
_WINDOWED_BY_DEFAULT = ("MistralForCausalLM", "MixtralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The model folder describes something pdserve cannot run."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections have biases
    o_bias: bool  # the output projection has a bias
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type and its parameters
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    torch_dtype: str | None = None
    # Mixture of experts (zero experts: a dense model). The layers in moe_layers route each token to
    # num_experts_per_tok of num_experts MLPs of moe_intermediate_size features, weighted by the
    # router's softmax over all experts (renormalised over the chosen ones if norm_topk_prob).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # Qwen3.5-MoE: beside the routed experts, one shared expert MLP every token goes through, its
    # output scaled by a sigmoid gate of the token (0: none).
    shared_expert_intermediate_size: int = 0
    # Hybrid models: each layer's token mixer (empty: every layer is full attention), the share of a
    # head that rotary embeddings turn, whether attention's output is gated by a sigmoid of a second
    # query-sized projection, and whether RMSNorm weights are stored as offsets from 1.
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    norm_weight_offset: float = 0.0
    # Gated DeltaNet layers: key heads (q, k) and value heads of their own sizes, and the width of
    # the causal convolution over q, k and v.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise UnsupportedModelError(
                f"unsupported model architecture {architectures or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        features = SUPPORTED_ARCHITECTURES[architecture]
        if architecture in _VISION_LANGUAGE:  # served text-only: its text model's config
            outer: dict[str, Any] = {
                key: raw[key] for key in ("tie_word_embeddings", "eos_token_id", "torch_dtype") if key in raw
            }
            raw = {**raw.get("text_config", {}), **outer, "architectures": [architecture]}
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope["rope_type"] = rope_type
        partial_rotary = float(
            rope.pop(
                "partial_rotary_factor", raw.get("partial_rotary_factor", 0.25 if architecture in _HYBRID else 1.0)
            )
        )
        # Qwen3.5's multimodal rotary: for text every section has the same position, which is plain rope.
        rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        uses_window = raw.get("use_sliding_window", architecture in _WINDOWED_BY_DEFAULT)
        window = raw.get("sliding_window") if uses_window else None
        num_layers = int(raw["num_hidden_layers"])
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if features["qkv_bias_only"] else attention_bias,
            o_bias=False if features["qkv_bias_only"] else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=features["qk_norm"],
            rope_theta=rope_theta,
            rope_scaling=rope,
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window else None,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            partial_rotary_factor=partial_rotary,
            **_experts(architecture, raw, num_layers),
            **_hybrid(architecture, raw, num_layers),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{path} is not a model folder: it has no config.json")
        config = cls.from_dict(json.loads(config_path.read_text()))
        generation_path = Path(path) / "generation_config.json"
        if generation_path.is_file():
            eos = json.loads(generation_path.read_text()).get("eos_token_id")
            extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            config.eos_token_ids += [int(e) for e in extra if int(e) not in config.eos_token_ids]
        return config

    @property
    def max_model_len(self) -> int:
        """The longest context this model runs exactly (a sliding window would change attention)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def routing(self) -> str:
        """What decides a token's experts, beyond the weights ("" for a dense model): two engines
        whose hidden states must agree (P/D) must agree on it."""
        if not self.num_experts:
            return ""
        return (
            f"experts={self.num_experts};top_k={self.num_experts_per_tok};"
            f"norm_topk_prob={self.norm_topk_prob};layers={','.join(map(str, self.moe_layers))};"
            f"shared={self.shared_expert_intermediate_size}"
        )

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with paged KV (all of them but a hybrid model's linear-attention layers)."""
        return tuple(i for i in range(self.num_layers) if not self.layer_types or self.layer_types[i] == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers whose state is one fixed-size slot per request (Gated DeltaNet)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def rotary_dim(self) -> int:
        """The leading features of each q and k head that rotary embeddings turn."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear-attention layer's convolution: its q, k and v side by side."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * (
            self.linear_value_head_dim
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * element_size


def _experts(architecture: str, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig`` (none for a dense architecture)."""
    shared = 0
    if architecture == "MixtralForCausalLM":  # every layer routed, the chosen experts' weights renormalised
        num_experts = int(raw["num_local_experts"])
        moe_layers: tuple[int, ...] = tuple(range(num_layers))
        moe_intermediate_size, norm_topk_prob = int(raw["intermediate_size"]), True
    elif architecture == "Qwen3MoeForCausalLM":
        # transformers 5 writes num_local_experts where Qwen's own configs say num_experts.
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = {int(layer) for layer in raw.get("mlp_only_layers") or []}
        moe_layers = tuple(
            layer for layer in range(num_layers) if num_experts and layer not in dense and (layer + 1) % step == 0
        )
        moe_intermediate_size = int(raw.get("moe_intermediate_size", 0))
        norm_topk_prob = bool(raw.get("norm_topk_prob", False))
    elif architecture in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        # Every layer routed, the chosen experts' weights renormalised, and a gated shared expert.
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        moe_layers = tuple(range(num_layers)) if num_experts else ()
        moe_intermediate_size, norm_topk_prob = int(raw.get("moe_intermediate_size", 0)), True
        shared = int(raw.get("shared_expert_intermediate_size", 0))
    else:
        return {}
    if not moe_layers:
        return {}
    top_k = int(raw.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
    if moe_intermediate_size < 1:
        raise UnsupportedModelError(f"an expert's intermediate size must be positive, got {moe_intermediate_size}")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": norm_topk_prob,
        "moe_layers": moe_layers,
        "shared_expert_intermediate_size": shared,
    }


def _hybrid(architecture: str, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The hybrid-model fields of ``ModelConfig`` (none for the other architectures)."""
    if architecture not in _HYBRID:
        return {}
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = int(raw.get("full_attention_interval", 4))
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedModelError(
            f"layer_types must name {num_layers} layers, each {FULL_ATTENTION} or {LINEAR_ATTENTION}; got {layer_types}"
        )
    fields = {
        "linear_num_key_heads": int(raw.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(raw.get("linear_num_value_heads", 32)),
        "linear_key_head_dim": int(raw.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(raw.get("linear_value_head_dim", 128)),
        "linear_conv_kernel_dim": int(raw.get("linear_conv_kernel_dim", 4)),
    }
    if FULL_ATTENTION not in layer_types:
        raise UnsupportedModelError("a hybrid model without full-attention layers is not supported")
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise UnsupportedModelError(
            f"{fields['linear_num_value_heads']} linear-attention value heads do not share "
            f"{fields['linear_num_key_heads']} key heads evenly"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported; supported: silu")
    return {
        "layer_types": tuple(layer_types),
        "attn_output_gate": bool(raw.get("attn_output_gate", True)),
        "norm_weight_offset": 1.0,
        **fields,
    }


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
