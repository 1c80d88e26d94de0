"""Loading model folders: sharded checkpoints, dtypes, and clear errors for what we cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.models.config import ModelConfig, UnsupportedModelError
from pdserve.models.dtype import resolve_dtype, resolve_kv_cache_dtype
from pdserve.models.loader import load_model
from pdserve.testing.hf_models import LLAMA3_ROPE, SHAPES, build_hf_model
from pdserve.worker.kv_cache import rows_per_state_slot


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


def test_kv_cache_dtypes_resolve_by_name():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_cache_dtype("bf16", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32, cpu) == torch.float16
    assert resolve_kv_cache_dtype("fp32", torch.bfloat16, gpu) == torch.float32
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, gpu) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, cpu) == torch.float8_e4m3fn  # the reference path
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        resolve_kv_cache_dtype("int4", torch.float32, cpu)


def test_the_kv_dtype_is_in_the_compatibility_hash_only_where_it_differs_from_the_models(tmp_path):
    from pdserve.kvtransfer.params import model_compat_hash

    build_hf_model("Llama", {"num_attention_heads": 4}, tmp_path)
    config = ModelConfig.from_folder(tmp_path)

    def compat(kv_dtype):
        return model_compat_hash(config, "weights", "torch.float32", 16, 1, "layout", "state", kv_dtype)

    # A cache in the model's dtype hashes as before --kv-cache-dtype existed: upgraded pools keep pairing.
    assert compat(None) == compat("torch.float32")
    assert len({compat(None), compat("torch.bfloat16"), compat("torch.float16")}) == 3


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


def test_kv_cache_scales_of_a_quantised_checkpoint_reach_their_layers(tmp_path):
    """``self_attn.k_scale`` / ``v_scale`` (scalars, as fp8-quantised checkpoints store them) become the layer's
    ``kv_scales``; a layer without them keeps 1.0; a scale that is not positive is refused by name."""
    build_hf_model("Llama", {"num_attention_heads": 4}, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    config = ModelConfig.from_folder(tmp_path)
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(2.0),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
    }
    save_file({**weights, **scales}, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)
    assert model.layers[0].self_attn.kv_scales == (2.0, 0.5)
    assert model.layers[1].self_attn.kv_scales == (1.0, 1.0)
    save_file({**weights, "model.layers.1.self_attn.v_scale": torch.tensor(0.0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.v_scale: a KV-cache scale must be positive"):
        load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)


def test_routed_layers_follow_mlp_only_layers_and_the_sparse_step():
    base = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    assert ModelConfig.from_dict(base).moe_layers == (0, 1, 2, 3, 4, 5)
    assert ModelConfig.from_dict({**base, "mlp_only_layers": [0, 4]}).moe_layers == (1, 2, 3, 5)
    assert ModelConfig.from_dict({**base, "decoder_sparse_step": 2}).moe_layers == (1, 3, 5)
    dense = ModelConfig.from_dict({**base, "num_experts": 0})
    assert (dense.num_experts, dense.moe_layers, dense.routing) == (0, (), "")
    # What routes a token is part of what two P/D engines must agree on.
    assert ModelConfig.from_dict(base).routing != ModelConfig.from_dict({**base, "norm_topk_prob": True}).routing
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 9})
    mixtral = ModelConfig.from_dict(
        {**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "sliding_window": 4096}
    )
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (4, 48, True)
    assert mixtral.moe_layers == tuple(range(6)) and mixtral.sliding_window == 4096


def test_expert_weights_missing_or_out_of_range_are_named(tmp_path):
    build_hf_model(
        "Qwen3Moe",
        {"num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        tmp_path,
    )
    weights = load_file(str(tmp_path / "model.safetensors"))
    config = ModelConfig.from_folder(tmp_path)
    save_file(
        {k: v for k, v in weights.items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.mlp\.w13"):
        load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)
    extra = weights["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    save_file({**weights, "model.layers.0.mlp.experts.4.up_proj.weight": extra}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no place in Qwen3MoeForCausalLM.*experts\.4"):
        load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)


HYBRID = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
}


def test_hybrid_layer_types_rotary_share_and_memory_per_request():
    config = ModelConfig.from_dict(HYBRID)
    # Every fourth layer full attention by default; the rest Gated DeltaNet.
    assert (config.attention_layers, config.linear_layers) == ((3, 7), (0, 1, 2, 4, 5, 6))
    assert config.rotary_dim == 4 and config.attn_output_gate
    assert config.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4  # two attention layers only
    # A slot: per linear layer a conv window of 80 channels x 3 and a 4 x 8 x 12 state, 2496 bytes; six
    # layers take two rows of 16-token blocks (8192 bytes each).
    assert rows_per_state_slot(config, torch.float32, 16) == 2
    assert rows_per_state_slot(config, torch.float32, 64) == 1
    explicit = ModelConfig.from_dict({**HYBRID, "layer_types": ["full_attention"] + ["linear_attention"] * 7})
    assert explicit.attention_layers == (0,)
    interval = ModelConfig.from_dict(
        {
            **HYBRID,
            "full_attention_interval": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
                "mrope_section": [1, 1, 0],
            },
        }
    )
    assert interval.attention_layers == (1, 3, 5, 7) and interval.rotary_dim == 8
    assert interval.rope_scaling == {"rope_type": "default"}  # text-only: the multimodal sections are plain rope
    # The vision-language class is read for its text model.
    outer = {"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": True}
    vl = ModelConfig.from_dict({**outer, "text_config": {k: v for k, v in HYBRID.items() if k != "architectures"}})
    assert (vl.hidden_size, vl.linear_layers, vl.tie_word_embeddings) == (32, config.linear_layers, True)
    # Qwen3.5-MoE: every layer routed (renormalised) with a gated shared expert, which the routing names.
    moe_fields = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    moe = ModelConfig.from_dict(
        {**HYBRID, **moe_fields, "shared_expert_intermediate_size": 24, "architectures": ["Qwen3_5MoeForCausalLM"]}
    )
    assert moe.moe_layers == tuple(range(8)) and moe.norm_topk_prob and moe.linear_layers == config.linear_layers
    assert moe.shared_expert_intermediate_size == 24 and "shared=24" in moe.routing
    dense = ModelConfig.from_dict({**HYBRID, "architectures": ["Qwen3ForCausalLM"]})
    assert not dense.is_hybrid and rows_per_state_slot(dense, torch.float32, 16) == 0


def test_bad_hybrid_configs_fail_clearly():
    with pytest.raises(UnsupportedModelError, match="layer_types must name 8 layers"):
        ModelConfig.from_dict({**HYBRID, "layer_types": ["full_attention"] * 7})
    with pytest.raises(UnsupportedModelError, match="each full_attention or linear_attention"):
        ModelConfig.from_dict({**HYBRID, "layer_types": ["sliding_attention"] * 8})
    with pytest.raises(UnsupportedModelError, match="3 linear-attention value heads"):
        ModelConfig.from_dict({**HYBRID, "linear_num_value_heads": 3})


def test_a_vision_language_checkpoint_loads_its_text_model_and_skips_the_vision_tower(tmp_path, caplog):
    build_hf_model(*SHAPES["qwen3.5-vl-text"], tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert any(name.startswith("model.visual.") for name in weights)
    with caplog.at_level("INFO", logger="pdserve.models.loader"):
        model = load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)
    assert "vision tower and multi-token prediction skipped" in caplog.text
    # Zero-centred norms are stored as 1 + w; the linear layers' gated norm is not zero-centred.
    stored = weights["model.language_model.layers.0.input_layernorm.weight"]
    torch.testing.assert_close(model.layers[0].input_layernorm.weight.detach(), stored + 1)
    gated = weights["model.language_model.layers.0.linear_attn.norm.weight"]
    assert model.layers[0].linear_attn is not None
    torch.testing.assert_close(model.layers[0].linear_attn.norm.weight.detach(), gated)
