"""Loading model folders: sharded checkpoints, dtypes, and clear errors for what we cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.models.config import ModelConfig, UnsupportedModelError, resolve_dtype
from pdserve.models.loader import load_model
from pdserve.testing.hf_models import LLAMA3_ROPE, build_hf_model


def _params(folder):
    config = ModelConfig.from_folder(folder)
    return config, {
        n: p.clone() for n, p in load_model(folder, config, torch.float32, torch.device("cpu"), 64).named_parameters()
    }


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    model = build_hf_model("Qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2}, tmp_path / "single")
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, single = _params(tmp_path / "single")
    _, sharded = _params(tmp_path / "sharded")
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_both_config_dialects_give_the_same_rope(tmp_path):
    build_hf_model("Llama", {"num_attention_heads": 4, "rope_scaling": dict(LLAMA3_ROPE)}, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = dict(raw.pop("rope_parameters"))
    old_style = {**raw, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}  # transformers 4.x
    new, old = (
        ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text())),
        ModelConfig.from_dict(old_style),
    )
    assert (new.rope_theta, new.rope_scaling) == (old.rope_theta, old.rope_scaling)
    assert new.rope_scaling["rope_type"] == "llama3"


def _edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_unsupported_things_fail_clearly(tmp_path):
    build_hf_model("Llama", {"num_attention_heads": 4}, tmp_path)
    _edit_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM, MistralForCausalLM"):
        ModelConfig.from_folder(tmp_path)
    _edit_config(tmp_path, architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn'"):
        ModelConfig.from_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config"):
        ModelConfig.from_folder(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16


def test_missing_and_unexpected_weights_are_named(tmp_path):
    build_hf_model("Llama", {"num_attention_heads": 4}, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    config = ModelConfig.from_folder(tmp_path)
    missing = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.mlp\.gate_up_proj"):
        load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)
    save_file({**weights, "model.layers.0.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no place in LlamaForCausalLM"):
        load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)
