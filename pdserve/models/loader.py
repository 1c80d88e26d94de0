"""Load a Hugging Face model folder into our CausalLM: safetensors (single file or sharded with
``model.safetensors.index.json``), memory-mapped, mapped onto our fused parameters.

Mixture-of-experts checkpoints store one gate/up/down triple per expert (Qwen3-MoE's
``mlp.experts.E.gate_proj``, Mixtral's ``block_sparse_moe.experts.E.w1``); each fills its slice of
the layer's stacked expert weights. Qwen3.5 checkpoints of the vision-language class keep the
text model under ``model.language_model``: read as the text model, their vision tower and
multi-token-prediction head skipped (one log line); their RMSNorm weights are offsets from 1,
stored as 1 + w. No transformers model code runs here. Every checkpoint tensor
must land somewhere and every parameter must be filled; anything else is an error naming the tensors.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.models.attention import attention_backend
from pdserve.models.config import ModelConfig
from pdserve.models.linear import Linear
from pdserve.models.moe import SharedExpert, SparseMoeBlock
from pdserve.models.parallel import TensorParallel, rank_config
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.transformer import CausalLM

logger = logging.getLogger(__name__)
# Checkpoint tensors that carry nothing we need (precomputed rotary tables in old checkpoints).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# Parts of a vision-language checkpoint a text-only engine does not run: the vision tower, the
# multi-token-prediction head (speculative decoding, not built).
_SKIPPED = re.compile(r"^(model\.visual\.|mtp\.)")
_TEXT_MODEL_PREFIX = "model.language_model."
# RMSNorms whose weights a checkpoint may store as offsets from 1 (ModelConfig.norm_weight_offset).
# Checkpoint rows a rank reads: all (None), a range, or ranges joined in order.
SourceRows = slice | tuple[slice, ...] | None
_OFFSET_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return shards


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: our parameter, the rows (output features) of it that the
    tensor fills, whether our parameter stores it transposed (our Linear keeps W as [in, out]),
    and the part of the checkpoint tensor this rank reads (rows, then columns; None: all of it)."""

    param: torch.Tensor
    rows: slice | None = None
    transposed: bool = False
    # A tuple of slices: pieces of the checkpoint's rows, read and joined in order (a linear layer's
    # q, k and v heads of this rank, which sit apart in the checkpoint's fused projection).
    source_rows: SourceRows = None
    source_columns: slice | None = None
    expert: int | None = None  # the index into stacked expert weights, before rows
    offset: float = 0.0  # added once copied (norm weights stored as offsets from 1)


def _target(model: CausalLM, name: str, config: ModelConfig, tp: TensorParallel) -> _Target | None:
    """``config`` is the whole model's (the checkpoint's shapes); ``model`` holds this rank's share."""
    match = _LAYER.match(name)
    if match is None:
        vocab = slice(model.embed_tokens.start, model.embed_tokens.end)
        simple = {
            "model.embed_tokens.weight": _Target(model.embed_tokens.weight, source_rows=vocab),
            "model.norm.weight": _Target(model.norm.weight, offset=config.norm_weight_offset),
            "lm_head.weight": None
            if model.lm_head is None
            else _Target(model.lm_head.weight_t, transposed=True, source_rows=vocab),
        }
        return simple.get(name)
    layer = model.layers[int(match.group(1))]
    if isinstance(layer.mlp, SparseMoeBlock) and match.group(2).startswith(("mlp.", "block_sparse_moe.")):
        return _expert_target(layer.mlp, match.group(2), config, tp)
    module_name, _, kind = match.group(2).rpartition(".")
    head_dim = config.head_dim
    q_start, q_end = tp.even_range(config.num_heads)
    kv_start, kv_end = tp.kv_head_range(config.num_kv_heads)
    inter_start, inter_end = tp.even_range(config.intermediate_size)
    q_size, kv_size, inter = (q_end - q_start) * head_dim, (kv_end - kv_start) * head_dim, inter_end - inter_start
    q_rows, kv_rows = slice(q_start * head_dim, q_end * head_dim), slice(kv_start * head_dim, kv_end * head_dim)
    inter_rows = slice(inter_start, inter_end)
    # A gated model's q_proj holds each head's query and gate, side by side: kept so in qkv_proj.
    width = 2 if config.attn_output_gate else 1
    q_width, q_source = width * q_size, slice(width * q_start * head_dim, width * q_end * head_dim)
    # Column-parallel: (our fused module, the rows it fills, the checkpoint rows this rank reads).
    fused: dict[str, tuple[str, slice | None, SourceRows]] = {
        "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q_width), q_source),
        "self_attn.k_proj": ("self_attn.qkv_proj", slice(q_width, q_width + kv_size), kv_rows),
        "self_attn.v_proj": ("self_attn.qkv_proj", slice(q_width + kv_size, q_width + 2 * kv_size), kv_rows),
        "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter), inter_rows),
        "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter), inter_rows),
        **_linear_attention_rows(config, tp),
    }
    linear = _linear_attention_split(config, tp)
    if module_name == "linear_attn.conv1d":  # one channel per q, k and v feature, split as they are
        module_name, kind = "linear_attn", "conv1d_weight"
        fused["linear_attn"] = ("linear_attn", None, linear.channels)
    if module_name == "linear_attn" and kind in ("dt_bias", "A_log"):  # one per value head
        fused["linear_attn"] = ("linear_attn", None, linear.value_heads)
    # Row-parallel: the checkpoint columns (input features) this rank reads; their biases are whole.
    split_inputs = {"self_attn.o_proj": q_rows, "mlp.down_proj": inter_rows, "linear_attn.out_proj": linear.values}
    module_name, rows, source_rows = fused.get(module_name, (module_name, None, None))
    source_columns = split_inputs.get(module_name) if kind == "weight" else None
    try:
        module = layer.get_submodule(module_name)
    except AttributeError:
        return None
    if isinstance(module, Linear) and kind == "weight":
        return _Target(module.weight_t, rows, True, source_rows, source_columns)
    param = getattr(module, kind, None)
    if not isinstance(param, torch.nn.Parameter):
        return None
    offset = config.norm_weight_offset if module_name in _OFFSET_NORMS else 0.0
    return _Target(param, rows, False, source_rows, offset=offset)


@dataclass(frozen=True)
class _LinearSplit:
    """The parts of a Gated DeltaNet layer's checkpoint tensors one rank reads: its key heads' q and
    k features and its value heads' v features (the convolution's channels, in that order), its
    value heads' features (z, the output projection's inputs), and its value heads themselves."""

    channels: tuple[slice, slice, slice]
    values: slice
    value_heads: slice


def _linear_attention_split(config: ModelConfig, tp: TensorParallel) -> _LinearSplit:
    key_start, key_end = tp.even_range(config.linear_num_key_heads)
    value_start, value_end = tp.even_range(config.linear_num_value_heads)
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    key_size = config.linear_num_key_heads * key_dim
    return _LinearSplit(
        (
            slice(key_start * key_dim, key_end * key_dim),
            slice(key_size + key_start * key_dim, key_size + key_end * key_dim),
            slice(2 * key_size + value_start * value_dim, 2 * key_size + value_end * value_dim),
        ),
        slice(value_start * value_dim, value_end * value_dim),
        slice(value_start, value_end),
    )


def _linear_attention_rows(config: ModelConfig, tp: TensorParallel) -> dict[str, tuple[str, slice | None, SourceRows]]:
    """A Gated DeltaNet layer's four input projections, as parts of its fused in_proj: (our module,
    the rows they fill, the checkpoint rows this rank reads)."""
    if not config.is_hybrid:
        return {}
    split = _linear_attention_split(config, tp)
    parts: dict[str, tuple[int, SourceRows]] = {
        "in_proj_qkv": (sum(piece.stop - piece.start for piece in split.channels), split.channels),
        "in_proj_z": (split.values.stop - split.values.start, split.values),
        "in_proj_b": (split.value_heads.stop - split.value_heads.start, split.value_heads),
        "in_proj_a": (split.value_heads.stop - split.value_heads.start, split.value_heads),
    }
    rows: dict[str, tuple[str, slice | None, SourceRows]] = {}
    start = 0
    for name, (size, source) in parts.items():
        rows[f"linear_attn.{name}"] = ("linear_attn.in_proj", slice(start, start + size), source)
        start += size
    return rows


def _expert_target(block: SparseMoeBlock, name: str, config: ModelConfig, tp: TensorParallel) -> _Target | None:
    """Where a routed layer's router or expert tensor ``name`` (``mlp.…`` or ``block_sparse_moe.…``) goes."""
    parts = name.split(".")
    if parts[0] == "block_sparse_moe":  # Mixtral's names for the same tensors
        parts[0] = "mlp"
        if len(parts) == 5 and parts[1] == "experts":
            parts[3] = _MIXTRAL_EXPERT.get(parts[3], parts[3])
        name = ".".join(parts)
    if name == "mlp.gate.weight":
        return _Target(block.gate_weight_t, transposed=True)
    if name.startswith("mlp.shared_expert") and block.shared_expert is not None:
        return _shared_expert_target(block.shared_expert, name, config, tp)
    match = _EXPERT.match(name)
    if match is None or int(match.group(1)) >= block.w13.shape[0]:
        return None
    expert, projection = int(match.group(1)), match.group(2)
    start, end = tp.even_range(config.moe_intermediate_size)
    rank_rows, inter = slice(start, end), end - start
    if projection == "down_proj":
        return _Target(block.w2, transposed=True, source_columns=rank_rows, expert=expert)
    rows = slice(0, inter) if projection == "gate_proj" else slice(inter, 2 * inter)
    return _Target(block.w13, rows, transposed=True, source_rows=rank_rows, expert=expert)


def _shared_expert_target(shared: SharedExpert, name: str, config: ModelConfig, tp: TensorParallel) -> _Target | None:
    """Where a Qwen3.5-MoE shared expert's tensor goes: its intermediate features split over the
    ranks as a dense MLP's are; its gate whole."""
    start, end = tp.even_range(config.shared_expert_intermediate_size)
    rank_rows, inter = slice(start, end), end - start
    weight_t = shared.gate_up_proj.weight_t
    targets = {
        "mlp.shared_expert_gate.weight": _Target(shared.gate_weight_t, transposed=True),
        "mlp.shared_expert.gate_proj.weight": _Target(weight_t, slice(0, inter), True, rank_rows),
        "mlp.shared_expert.up_proj.weight": _Target(weight_t, slice(inter, 2 * inter), True, rank_rows),
        "mlp.shared_expert.down_proj.weight": _Target(
            shared.down_proj.weight_t, transposed=True, source_columns=rank_rows
        ),
    }
    return targets.get(name)


def _read(checkpoint: Any, name: str, target: _Target) -> torch.Tensor:
    """The part of a checkpoint tensor this rank needs; only those bytes are read (memory-mapped)."""
    if target.source_rows is None and target.source_columns is None:
        return checkpoint.get_tensor(name)
    part = checkpoint.get_slice(name)
    if isinstance(target.source_rows, tuple):
        return torch.cat([part[rows] for rows in target.source_rows])
    rows = target.source_rows or slice(None)
    return part[rows] if target.source_columns is None else part[rows, target.source_columns]


def load_model(
    folder: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """The model (this rank's share of it, under tensor parallelism ``tp``) with its weights."""
    folder = Path(folder)
    tp = tp or TensorParallel()
    rotary = RotaryEmbedding(config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling, dtype, device)
    # Built on the meta device: no time spent initialising weights that are overwritten next.
    with torch.device("meta"):
        model = CausalLM(rank_config(config, tp), attention_backend(device), rotary, tp)
    model = model.to_empty(device=device).to(dtype)

    filled: dict[int, int] = {}  # id(param) -> rows filled
    unexpected = []
    skipped = 0
    with torch.no_grad():
        for path in checkpoint_files(folder):
            with safe_open(str(path), framework="pt") as checkpoint:
                for stored_name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if _SKIPPED.match(stored_name):
                        skipped += 1
                        continue
                    name = stored_name.replace(_TEXT_MODEL_PREFIX, "model.", 1)
                    if _IGNORED.match(name) or (name == "lm_head.weight" and model.lm_head is None):
                        continue  # tied checkpoints sometimes store the shared matrix twice
                    target = _target(model, name, config, tp)
                    if target is None:
                        unexpected.append(name)
                        continue
                    tensor = _read(checkpoint, stored_name, target)
                    destination = target.param if target.expert is None else target.param[target.expert]
                    destination = destination.t() if target.transposed else destination
                    if target.rows is not None:
                        destination = destination[target.rows]
                    if destination.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(destination.shape)}"
                        )
                    destination.copy_(tensor)
                    if target.offset:
                        destination.add_(target.offset)
                    filled[id(target.param)] = filled.get(id(target.param), 0) + tensor.numel()
    if skipped:
        logger.info(
            "%s: %d tensors of the vision tower and multi-token prediction skipped (text only)", folder, skipped
        )
    if unexpected:
        raise ValueError(f"checkpoint tensors with no place in {config.architecture}: {unexpected[:8]}")
    missing = [name for name, param in model.named_parameters() if filled.get(id(param), 0) != param.numel()]
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")
    return model.eval()
