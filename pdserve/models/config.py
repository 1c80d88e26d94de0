"""ModelConfig: what pdserve needs from a Hugging Face model folder's ``config.json``.

Reads both config dialects: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). The fields every family shares are read here; what sets a family apart (its
attention's variant, which layers route tokens to experts or mix them with linear attention) its
declaration reads (``models/family.py``; the family of each architecture: ``models/families.py``).
Mixture-of-experts models are the dense layout with routed experts in place of some layers' MLP;
hybrid models (Qwen3.5) mix two token mixers, named per layer by ``layer_types``. A vision-language
checkpoint is read for its text model. Unsupported architectures and features fail here, with a
clear error, before any weight is read.

No torch: the API process reads model configs too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.models.families import ARCHITECTURES, supported_architecture
from pdserve.models.family import FULL_ATTENTION, LINEAR_ATTENTION, Family, UnsupportedModelError

if TYPE_CHECKING:
    import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The activation of the MLPs (SwiGLU) and of the linear attention's gate.
SUPPORTED_ACTIVATIONS = ("silu",)
# What ``--kv-cache-dtype`` may name (models/dtype.py resolves them): the model's dtype, 32 or 16 bits,
# or (on a GPU) 8-bit floats with a scale per layer.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
KV_CACHE_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "fp8": "fp8_e4m3",
}
# A vision-language config.json's own fields that hold for its text model too.
_OUTER_FIELDS = ("tie_word_embeddings", "eos_token_id", "torch_dtype")


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
    # head that rotary embeddings turn, and whether attention's output is gated by a sigmoid of a
    # second query-sized projection.
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    # Gated DeltaNet layers: key heads (q, k) and value heads of their own sizes, and the width of
    # the causal convolution over q, k and v.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = supported_architecture(raw.get("architectures") or [], raw.get("model_type"))
        layers = ARCHITECTURES[architecture].layers
        if isinstance(raw.get("text_config"), dict):  # a vision-language class, served text-only
            outer = {key: raw[key] for key in _OUTER_FIELDS if key in raw}
            raw = {**raw["text_config"], **outer, "architectures": [architecture]}
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
        partial_rotary = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor"))
        # Qwen3.5's multimodal rotary: for text every section has the same position, which is plain rope.
        rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
        activation = raw.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {activation!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        uses_window = raw.get("use_sliding_window", layers.sliding_window_by_default)
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
            qkv_bias=True if layers.qkv_bias_only else attention_bias,
            o_bias=False if layers.qkv_bias_only else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=layers.qk_norm,
            rope_theta=rope_theta,
            rope_scaling=rope,
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window else None,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            partial_rotary_factor=layers.partial_rotary_factor if partial_rotary is None else float(partial_rotary),
            **layers.read_layers(raw, num_layers),
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

    @property
    def family(self) -> Family:
        """The declaration of the family this architecture belongs to."""
        return ARCHITECTURES[self.architecture]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * dtype.itemsize
