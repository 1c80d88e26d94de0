"""Load a Hugging Face model folder into our CausalLM: safetensors (single file or sharded with
``model.safetensors.index.json``), memory-mapped, mapped onto our fused parameters.

Mixture-of-experts checkpoints store one gate/up/down triple per expert (Qwen3-MoE's
``mlp.experts.E.gate_proj``, Mixtral's ``block_sparse_moe.experts.E.w1``); each fills its slice of
the layer's stacked expert weights. No transformers model code runs here. Every checkpoint tensor
must land somewhere and every parameter must be filled; anything else is an error naming the tensors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.models.attention import attention_backend
from pdserve.models.config import ModelConfig
from pdserve.models.moe import SparseMoeBlock
from pdserve.models.parallel import TensorParallel, rank_config
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.transformer import CausalLM, Linear

# Checkpoint tensors that carry nothing we need (precomputed rotary tables in old checkpoints).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
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
    source_rows: slice | None = None
    source_columns: slice | None = None
    expert: int | None = None  # the index into stacked expert weights, before rows


def _target(model: CausalLM, name: str, config: ModelConfig, tp: TensorParallel) -> _Target | None:
    """``config`` is the whole model's (the checkpoint's shapes); ``model`` holds this rank's share."""
    match = _LAYER.match(name)
    if match is None:
        vocab = slice(model.embed_tokens.start, model.embed_tokens.end)
        simple = {
            "model.embed_tokens.weight": _Target(model.embed_tokens.weight, source_rows=vocab),
            "model.norm.weight": _Target(model.norm.weight),
            "lm_head.weight": None if model.lm_head is None else _Target(model.lm_head.weight, source_rows=vocab),
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
    # Column-parallel: (our fused module, the rows it fills, the checkpoint rows this rank reads).
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q_size), q_rows),
        "self_attn.k_proj": ("self_attn.qkv_proj", slice(q_size, q_size + kv_size), kv_rows),
        "self_attn.v_proj": ("self_attn.qkv_proj", slice(q_size + kv_size, q_size + 2 * kv_size), kv_rows),
        "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter), inter_rows),
        "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter), inter_rows),
    }
    # Row-parallel: the checkpoint columns (input features) this rank reads; their biases are whole.
    split_inputs = {"self_attn.o_proj": q_rows, "mlp.down_proj": inter_rows}
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
    return _Target(param, rows, False, source_rows)


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


def _read(checkpoint: Any, name: str, target: _Target) -> torch.Tensor:
    """The part of a checkpoint tensor this rank needs; only those bytes are read (memory-mapped)."""
    if target.source_rows is None and target.source_columns is None:
        return checkpoint.get_tensor(name)
    part = checkpoint.get_slice(name)
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
    rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, dtype, device)
    # Built on the meta device: no time spent initialising weights that are overwritten next.
    with torch.device("meta"):
        model = CausalLM(rank_config(config, tp), attention_backend(device), rotary, tp)
    model = model.to_empty(device=device).to(dtype)

    filled: dict[int, int] = {}  # id(param) -> rows filled
    unexpected = []
    with torch.no_grad():
        for path in checkpoint_files(folder):
            with safe_open(str(path), framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if _IGNORED.match(name) or (name == "lm_head.weight" and model.lm_head is None):
                        continue  # tied checkpoints sometimes store the shared matrix twice
                    target = _target(model, name, config, tp)
                    if target is None:
                        unexpected.append(name)
                        continue
                    tensor = _read(checkpoint, name, target)
                    destination = target.param if target.expert is None else target.param[target.expert]
                    destination = destination.t() if target.transposed else destination
                    if target.rows is not None:
                        destination = destination[target.rows]
                    if destination.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(destination.shape)}"
                        )
                    destination.copy_(tensor)
                    filled[id(target.param)] = filled.get(id(target.param), 0) + tensor.numel()
    if unexpected:
        raise ValueError(f"checkpoint tensors with no place in {config.architecture}: {unexpected[:8]}")
    missing = [name for name, param in model.named_parameters() if filled.get(id(param), 0) != param.numel()]
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")
    return model.eval()
