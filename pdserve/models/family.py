"""What a model family declares: how its ``config.json`` reads into ModelConfig beyond the fields
every family shares, which variant of the shared building blocks its decoder layers use, and how its
checkpoint names its tensors. Each family is one module (``models/llama.py``, ``models/qwen3.py``, ...)
holding one ``Family``; ``models/families.py`` says which Hugging Face architectures each serves.

Declarations only, no torch: the API process reads model configs through them. The building blocks
themselves are ``models/transformer.py`` (attention, the SwiGLU MLP, the decoder layer),
``models/moe.py`` (routed experts) and ``models/gated_deltanet.py`` (linear attention).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A hybrid model's layer_types: which token mixer each layer has.
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


class UnsupportedModelError(ValueError):
    """The model folder describes something pdserve cannot run."""


def dense(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """A dense family's layers: every one attention then a dense MLP, so no ModelConfig fields to add."""
    return {}


@dataclass(frozen=True)
class Layers:
    """Which variant of the shared blocks a family's decoder layers use. Every layer is RMSNorm, a
    token mixer, RMSNorm, an MLP (``models/transformer.py`` DecoderLayer); the mixer is attention
    unless a hybrid model's layer_types says linear attention, the MLP a SwiGLU one unless the layer
    routes tokens to experts."""

    qk_norm: bool = False  # attention normalises each q and k head (RMSNorm) before rotary
    qkv_bias_only: bool = False  # q, k and v projections have biases, the output projection none
    sliding_window_by_default: bool = False  # config.json's sliding_window applies without use_sliding_window
    partial_rotary_factor: float = 1.0  # the share of each head rotary turns, where config.json does not say
    # The ModelConfig fields of layers built otherwise (routed experts, linear attention, an output-gated
    # attention), read from config.json's fields and its number of layers.
    read_layers: Callable[[dict[str, Any], int], dict[str, Any]] = dense


@dataclass(frozen=True)
class Experts:
    """A routed layer's experts in a checkpoint: ``{prefix}.{expert}.{projection}.weight`` each, which
    our ``SparseMoeBlock`` stacks (gate and up in ``w13``, down in ``w2``)."""

    prefix: str
    projections: Mapping[str, str]  # the checkpoint's projection name -> "gate", "up" or "down"


@dataclass(frozen=True)
class Checkpoint:
    """How a family's checkpoint names its tensors, in terms of our parameters. Names inside a layer
    are those after ``model.layers.N.``; a tensor no rule mentions is ours under its own name."""

    # A checkpoint module whose tensors are rows of one of our fused modules: -> (our module, which
    # part of it). The loader knows where each part's rows lie on a tensor-parallel rank.
    packed: Mapping[str, tuple[str, str]]
    # A checkpoint tensor that is one of our parameters under another name. A parameter named
    # ``weight_t`` or ``*_weight_t`` holds the checkpoint's matrix transposed.
    renamed: Mapping[str, str] = field(default_factory=dict)
    experts: Experts | None = None
    # Name prefixes that are ours under another prefix (a vision-language checkpoint's text model).
    prefixes: Mapping[str, str] = field(default_factory=dict)
    # Name prefixes of parts the engine does not run: prefix -> what they are (for the log).
    skipped: Mapping[str, str] = field(default_factory=dict)
    # RMSNorm weights stored as offsets from 1 (the loader adds the 1): names inside a layer, or whole.
    offset_norms: tuple[str, ...] = ()
    # Name endings of tensors that carry nothing we need (precomputed rotary tables in old checkpoints).
    ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Family:
    name: str  # as ``pdserve demo-model --family`` and the logs name it
    layers: Layers
    checkpoint: Checkpoint


# The projections under Llama's names, which most families kept: q, k and v fused in our attention's
# qkv_proj, gate and up in our MLP's gate_up_proj (one matmul each).
ATTENTION_PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
}
MLP_PROJECTIONS = {"mlp.gate_proj": ("mlp.gate_up_proj", "gate"), "mlp.up_proj": ("mlp.gate_up_proj", "up")}
DENSE_PROJECTIONS = {**ATTENTION_PROJECTIONS, **MLP_PROJECTIONS}


def routed_layers(
    raw: dict[str, Any],
    num_experts: int,
    moe_layers: tuple[int, ...],
    intermediate_size: int,
    norm_topk_prob: bool,
    shared_expert_intermediate_size: int = 0,
) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig, checked (none when no layer is routed): the
    layers in ``moe_layers`` route each token to config.json's num_experts_per_tok of ``num_experts``."""
    if not moe_layers:
        return {}
    top_k = int(raw.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
    if intermediate_size < 1:
        raise UnsupportedModelError(f"an expert's intermediate size must be positive, got {intermediate_size}")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": intermediate_size,
        "norm_topk_prob": norm_topk_prob,
        "moe_layers": moe_layers,
        "shared_expert_intermediate_size": shared_expert_intermediate_size,
    }
