"""ModelConfig: what pdserve needs from a Hugging Face model folder's ``config.json``.

Reads both config dialects: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). Mixture-of-experts models (Qwen3-MoE, Mixtral) are the dense layout with
routed experts in place of some layers' MLP: which layers, how many experts, how many per token.
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
}
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
        if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
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
            **_experts(architecture, raw, num_layers),
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
            f"norm_topk_prob={self.norm_topk_prob};layers={','.join(map(str, self.moe_layers))}"
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def _experts(architecture: str, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig`` (none for a dense architecture)."""
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
