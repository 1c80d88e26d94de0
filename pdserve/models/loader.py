"""Load a Hugging Face model folder into our CausalLM: safetensors (single file or sharded with
``model.safetensors.index.json``), memory-mapped, mapped onto our fused parameters.

The names are the family's (``Checkpoint`` in ``models/family.py``, declared by each family's
module): which checkpoint tensors are rows of one of our fused modules, which are ours under another
name, how routed experts are named (each expert's gate/up/down fills its slice of the layer's stacked
expert weights), which parts a text-only engine skips (one log line), which norms are stored as
offsets from 1. What this module knows is our side: where each part of a fused module lies, and
which rows or columns of a tensor a tensor-parallel rank reads. No transformers model code runs
here. Every checkpoint tensor must land somewhere and every parameter must be filled; anything else
is an error naming the tensors.
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
from pdserve.models.family import Checkpoint, Experts
from pdserve.models.linear import Linear
from pdserve.models.moe import SparseMoeBlock
from pdserve.models.parallel import TensorParallel, rank_config
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.transformer import Attention, CausalLM

logger = logging.getLogger(__name__)
# Checkpoint rows a rank reads: all (None), a range, or ranges joined in order.
SourceRows = slice | tuple[slice, ...] | None
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# An 8-bit KV cache's per-layer scales, as quantised checkpoints store them (scalars).
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


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


@dataclass(frozen=True)
class _Layout:
    """Where a rank's share of each split tensor lies: the tensor-parallel layout of our blocks."""

    # (our fused module, part) -> (the rows of it the part fills, the checkpoint rows this rank reads)
    parts: dict[tuple[str, str], tuple[slice, SourceRows]]
    # Our row-parallel modules (a layer's) -> the checkpoint columns (input features) this rank reads;
    # their biases are whole.
    columns: dict[str, slice]
    # Our other split parameters (a layer's) -> the checkpoint rows this rank reads.
    rows: dict[str, SourceRows]
    expert_rows: slice  # each routed expert's intermediate features


def _layout(config: ModelConfig, tp: TensorParallel) -> _Layout:
    """``config`` is the whole model's (the checkpoint's shapes)."""
    head_dim = config.head_dim
    q_start, q_end = tp.even_range(config.num_heads)
    kv_start, kv_end = tp.kv_head_range(config.num_kv_heads)
    q_size, kv_size = (q_end - q_start) * head_dim, (kv_end - kv_start) * head_dim
    q_rows, kv_rows = slice(q_start * head_dim, q_end * head_dim), slice(kv_start * head_dim, kv_end * head_dim)
    # A gated model's q_proj holds each head's query and gate, side by side: kept so in qkv_proj.
    width = 2 if config.attn_output_gate else 1
    q_width, q_source = width * q_size, slice(width * q_start * head_dim, width * q_end * head_dim)
    mlp, mlp_rows = _halves(tp, config.intermediate_size)
    shared, shared_rows = _halves(tp, config.shared_expert_intermediate_size)
    linear = _linear_attention_split(config, tp)
    return _Layout(
        parts={
            ("self_attn.qkv_proj", "q"): (slice(0, q_width), q_source),
            ("self_attn.qkv_proj", "k"): (slice(q_width, q_width + kv_size), kv_rows),
            ("self_attn.qkv_proj", "v"): (slice(q_width + kv_size, q_width + 2 * kv_size), kv_rows),
            **{("mlp.gate_up_proj", part): rows for part, rows in mlp.items()},
            **{("mlp.shared_expert.gate_up_proj", part): rows for part, rows in shared.items()},
            **{("linear_attn.in_proj", part): rows for part, rows in _linear_attention_parts(linear).items()},
        },
        columns={
            "self_attn.o_proj": q_rows,
            "mlp.down_proj": mlp_rows,
            "mlp.shared_expert.down_proj": shared_rows,
            "linear_attn.out_proj": linear.values,
        },
        rows={
            # The convolution has one channel per q, k and v feature, split as they are; dt_bias and
            # A_log one value per value head.
            "linear_attn.conv1d_weight": linear.channels,
            "linear_attn.dt_bias": linear.value_heads,
            "linear_attn.A_log": linear.value_heads,
        },
        expert_rows=slice(*tp.even_range(config.moe_intermediate_size)),
    )


def _halves(tp: TensorParallel, intermediate_size: int) -> tuple[dict[str, tuple[slice, SourceRows]], slice]:
    """A SwiGLU MLP's gate and up parts of its gate_up_proj (this rank's intermediate features of
    each, side by side), and the checkpoint rows of those features."""
    start, end = tp.even_range(intermediate_size)
    rows, inter = slice(start, end), end - start
    return {"gate": (slice(0, inter), rows), "up": (slice(inter, 2 * inter), rows)}, rows


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


def _linear_attention_parts(split: _LinearSplit) -> dict[str, tuple[slice, SourceRows]]:
    """A Gated DeltaNet layer's four input projections as parts of its fused in_proj: (the rows
    they fill, the checkpoint rows this rank reads)."""
    sources: dict[str, tuple[int, SourceRows]] = {
        "qkv": (sum(piece.stop - piece.start for piece in split.channels), split.channels),
        "z": (split.values.stop - split.values.start, split.values),
        "b": (split.value_heads.stop - split.value_heads.start, split.value_heads),
        "a": (split.value_heads.stop - split.value_heads.start, split.value_heads),
    }
    parts: dict[str, tuple[slice, SourceRows]] = {}
    start = 0
    for name, (size, source) in sources.items():
        parts[name] = (slice(start, start + size), source)
        start += size
    return parts


def _target(model: CausalLM, name: str, checkpoint: Checkpoint, layout: _Layout) -> _Target | None:
    """Where the checkpoint tensor ``name`` goes in ``model`` (this rank's share), or None."""
    match = _LAYER.match(name)
    if match is None:
        return _top_level_target(model, name, checkpoint)
    layer = model.layers[int(match.group(1))]
    rest = match.group(2)
    if checkpoint.experts is not None and rest.startswith(checkpoint.experts.prefix + "."):
        block = layer.mlp  # a dense layer (Qwen3-MoE's mlp_only_layers) has no place for experts
        return _expert_target(block, rest, checkpoint.experts, layout) if isinstance(block, SparseMoeBlock) else None
    module_name, _, kind = rest.rpartition(".")
    rows: slice | None = None
    if module_name in checkpoint.packed:
        module_name, part = checkpoint.packed[module_name]
        rows, source_rows = layout.parts[module_name, part]
    else:
        module_name, _, kind = checkpoint.renamed.get(rest, rest).rpartition(".")
        source_rows = layout.rows.get(f"{module_name}.{kind}")
    try:
        module = layer.get_submodule(module_name)
    except AttributeError:
        return None
    if isinstance(module, Linear) and kind == "weight":
        return _Target(module.weight_t, rows, True, source_rows, layout.columns.get(module_name))
    param = getattr(module, kind, None)
    if not isinstance(param, torch.nn.Parameter):
        return None
    offset = 1.0 if rest in checkpoint.offset_norms else 0.0
    return _Target(param, rows, kind.endswith("weight_t"), source_rows, offset=offset)


def _top_level_target(model: CausalLM, name: str, checkpoint: Checkpoint) -> _Target | None:
    """The embedding and the LM head (this rank's vocabulary rows of each), and the final norm."""
    vocab = slice(model.embed_tokens.start, model.embed_tokens.end)
    if name == "model.embed_tokens.weight":
        return _Target(model.embed_tokens.weight, source_rows=vocab)
    if name == "model.norm.weight":
        return _Target(model.norm.weight, offset=1.0 if name in checkpoint.offset_norms else 0.0)
    if name == "lm_head.weight" and model.lm_head is not None:
        return _Target(model.lm_head.weight_t, transposed=True, source_rows=vocab)
    return None


def _expert_target(block: SparseMoeBlock, name: str, experts: Experts, layout: _Layout) -> _Target | None:
    """Where a routed expert's projection ``name`` (inside its layer) goes in the layer's stacked weights."""
    expert, _, rest = name.removeprefix(experts.prefix + ".").partition(".")
    projection, _, kind = rest.partition(".")
    part = experts.projections.get(projection)
    if part is None or kind != "weight" or not expert.isdigit() or int(expert) >= block.w13.shape[0]:
        return None
    if part == "down":
        return _Target(block.w2, transposed=True, source_columns=layout.expert_rows, expert=int(expert))
    inter = layout.expert_rows.stop - layout.expert_rows.start
    rows = slice(0, inter) if part == "gate" else slice(inter, 2 * inter)
    return _Target(block.w13, rows, transposed=True, source_rows=layout.expert_rows, expert=int(expert))


def _set_kv_scale(model: CausalLM, name: str, checkpoint: Any, stored_name: str) -> bool:
    """A layer's KV-cache scale (``model.layers.N.self_attn.k_scale`` / ``v_scale``) put where its attention
    reads it (``Attention.kv_scales``); False for any other tensor."""
    match = _KV_SCALE.match(name)
    if match is None:
        return False
    attention = model.layers[int(match.group(1))].self_attn
    if not isinstance(attention, Attention):
        raise ValueError(f"{name}: layer {match.group(1)} has no attention to scale")
    value = float(checkpoint.get_tensor(stored_name).float().reshape(-1)[0])
    if not value > 0:
        raise ValueError(f"{name}: a KV-cache scale must be positive, got {value}")
    k_scale, v_scale = attention.kv_scales
    attention.kv_scales = (value, v_scale) if match.group(2) == "k" else (k_scale, value)
    return True


def _renamed_prefix(name: str, checkpoint: Checkpoint) -> str:
    """``name`` with a prefix the family renames (a vision-language class's text model) made ours."""
    for theirs, ours in checkpoint.prefixes.items():
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name


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

    names = config.family.checkpoint
    layout = _layout(config, tp)
    filled: dict[int, int] = {}  # id(param) -> rows filled
    unexpected = []
    skipped = 0
    with torch.no_grad():
        for path in checkpoint_files(folder):
            with safe_open(str(path), framework="pt") as checkpoint:
                for stored_name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if stored_name.startswith(tuple(names.skipped)):
                        skipped += 1
                        continue
                    name = _renamed_prefix(stored_name, names)
                    if name.endswith(names.ignored) or (name == "lm_head.weight" and model.lm_head is None):
                        continue  # tied checkpoints sometimes store the shared matrix twice
                    if _set_kv_scale(model, name, checkpoint, stored_name):
                        continue
                    target = _target(model, name, names, layout)
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
            "%s: %d tensors of %s skipped (not run here)", folder, skipped, " and ".join(names.skipped.values())
        )
    if unexpected:
        raise ValueError(f"checkpoint tensors with no place in {config.architecture}: {unexpected[:8]}")
    missing = [name for name, param in model.named_parameters() if filled.get(id(param), 0) != param.numel()]
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")
    return model.eval()
