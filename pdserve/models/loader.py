"""Load a Hugging Face model folder into our CausalLM: safetensors (single file or sharded with
``model.safetensors.index.json``), memory-mapped, mapped onto our fused parameters.

No transformers model code runs here. Every checkpoint tensor must land somewhere and every
parameter must be filled; anything else is an error naming the tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.models.attention import attention_backend
from pdserve.models.config import ModelConfig
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.transformer import CausalLM, Linear

# Checkpoint tensors that carry nothing we need (precomputed rotary tables in old checkpoints).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


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


def _target(model: CausalLM, name: str) -> tuple[torch.Tensor, slice | None, bool] | None:
    """Where a checkpoint tensor goes: our parameter, the rows (output features) of it that the
    tensor fills, and whether our parameter stores it transposed (our Linear keeps W as [in, out])."""
    config = model.config
    match = _LAYER.match(name)
    if match is None:
        simple = {
            "model.embed_tokens.weight": model.embed_tokens.weight,
            "model.norm.weight": model.norm.weight,
            "lm_head.weight": None if model.lm_head is None else model.lm_head.weight,
        }
        param = simple.get(name)
        return None if param is None else (param, None, False)
    layer = model.layers[int(match.group(1))]
    module_name, _, kind = match.group(2).rpartition(".")
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q_size)),
        "self_attn.k_proj": ("self_attn.qkv_proj", slice(q_size, q_size + kv_size)),
        "self_attn.v_proj": ("self_attn.qkv_proj", slice(q_size + kv_size, q_size + 2 * kv_size)),
        "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
    }
    module_name, rows = fused.get(module_name, (module_name, None))
    try:
        module = layer.get_submodule(module_name)
    except AttributeError:
        return None
    if isinstance(module, Linear) and kind == "weight":
        return module.weight_t, rows, True
    param = getattr(module, kind, None)
    return None if not isinstance(param, torch.nn.Parameter) else (param, rows, False)


def load_model(
    folder: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> CausalLM:
    folder = Path(folder)
    rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, dtype, device)
    # Built on the meta device: no time spent initialising weights that are overwritten next.
    with torch.device("meta"):
        model = CausalLM(config, attention_backend(device), rotary)
    model = model.to_empty(device=device).to(dtype)

    filled: dict[int, int] = {}  # id(param) -> rows filled
    unexpected = []
    with torch.no_grad():
        for path in checkpoint_files(folder):
            with safe_open(str(path), framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if _IGNORED.match(name) or (name == "lm_head.weight" and model.lm_head is None):
                        continue  # tied checkpoints sometimes store the shared matrix twice
                    target = _target(model, name)
                    if target is None:
                        unexpected.append(name)
                        continue
                    param, rows, transposed = target
                    tensor = checkpoint.get_tensor(name)
                    destination = param.t() if transposed else param
                    if rows is not None:
                        destination = destination[rows]
                    if destination.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(destination.shape)}"
                        )
                    destination.copy_(tensor)
                    filled[id(param)] = filled.get(id(param), 0) + tensor.numel()
    if unexpected:
        raise ValueError(f"checkpoint tensors with no place in {config.architecture}: {unexpected[:8]}")
    missing = [name for name, param in model.named_parameters() if filled.get(id(param), 0) != param.numel()]
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")
    return model.eval()
