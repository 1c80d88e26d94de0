"""The built-in demo model: a tiny seeded Qwen3-family model with a byte-level BPE tokenizer and
a ChatML chat template, built locally in seconds (no download), so everything runs out of the box.

Its weights are random (normal, std 0.2, so the logits are peaked and greedy decoding is stable
across summation orders): it speaks gibberish, fluently and reproducibly. ``pdserve demo-model
--family`` writes other families at the same scale (``families.DEMO_FAMILIES``): ``qwen3-moe`` routes each token
to 2 of 8 experts in every layer; ``qwen3.5`` is hybrid, three Gated DeltaNet layers then one gated
full-attention layer.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.models.families import DEMO_FAMILIES

DEMO_MODEL_NAME = "pdserve-demo-qwen3-v2"  # v2: the chat template renders tools; thinking and tool-call tokens
SEED = 1234
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's markup tokens: whole tokens that stay in decoded text (not special), as in Qwen's tokenizers, so
# the reasoning and tool-call parsers find them.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# ChatML in the style of Qwen3's template: a tools section in the system turn, assistant tool calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool results as <tool_response> in a user turn,
# and ``enable_thinking=False`` closing an empty think block in the generation prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] or '' %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set arguments = call['function']['arguments'] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- arguments if arguments is string else (arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
ARCHITECTURE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
}
_WORDS = (
    "the",
    "a",
    "one",
    "every",
    "some",
    "model",
    "token",
    "cache",
    "block",
    "prefill",
    "decode",
    "router",
    "pod",
    "serve",
    "stream",
    "fast",
    "slow",
    "small",
    "large",
    "memory",
    "request",
    "answer",
    "question",
    "layer",
    "head",
    "key",
    "value",
    "query",
    "batch",
    "step",
    "scheduler",
    "engine",
    "kernel",
    "transfer",
    "lease",
    "hash",
    "prefix",
    "queue",
    "run",
    "wait",
    "finish",
    "start",
    "read",
    "write",
    "is",
    "was",
    "will",
    "can",
    "must",
    "may",
    "not",
    "and",
    "or",
    "but",
    "with",
    "from",
    "into",
    "over",
    "under",
    "after",
    "before",
)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """The demo model's folder, built on first use. Safe when several processes start at once:
    each builds in a private temporary folder and renames it into place; the first rename wins."""
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / DEMO_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=cache_dir))
    try:
        write_demo_model(scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _corpus(num_lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize()
        lines.append(f"{sentence}{rng.choice('.?!')} {rng.randint(0, 9999)}")
    return lines


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in MARKUP_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    wrapped.save_pretrained(str(path))


def write_demo_model(path: str | Path, seed: int = SEED, family: str = "qwen3") -> Path:
    """Write the demo model (config.json, model.safetensors, tokenizer files) into ``path``.
    Another ``seed`` gives a checkpoint of the same shape with other weights (a "fine-tune");
    another ``family`` (``families.DEMO_FAMILIES``) the same scale in that family's layout."""
    if family not in DEMO_FAMILIES:
        raise ValueError(f"unknown demo model family {family!r}; known: {', '.join(DEMO_FAMILIES)}")
    architecture, model_type, extra = DEMO_FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arch = {**ARCHITECTURE, **extra}
    write_tokenizer(path, arch["vocab_size"])
    eos_id = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        **arch,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "initializer_range": 0.2,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * config["initializer_range"]

    def mlp(prefix: str, inter: int) -> dict[str, torch.Tensor]:
        return {
            prefix + "gate_proj.weight": normal(inter, hidden),
            prefix + "up_proj.weight": normal(inter, hidden),
            prefix + "down_proj.weight": normal(hidden, inter),
        }

    hidden = arch["hidden_size"]
    q_size = arch["num_attention_heads"] * arch["head_dim"]
    kv_size = arch["num_key_value_heads"] * arch["head_dim"]
    hybrid = "layer_types" in arch
    # Qwen3.5 stores its RMSNorm weights as offsets from 1 and gates attention with a second query.
    norm = torch.zeros if hybrid else torch.ones
    tensors = {"model.embed_tokens.weight": normal(arch["vocab_size"], hidden), "model.norm.weight": norm(hidden)}
    for layer in range(arch["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors.update(
            {
                prefix + "input_layernorm.weight": norm(hidden),
                prefix + "post_attention_layernorm.weight": norm(hidden),
            }
        )
        if hybrid and arch["layer_types"][layer] == "linear_attention":
            tensors.update(_linear_attention(prefix + "linear_attn.", arch, normal))
        else:
            tensors.update(
                {
                    prefix + "self_attn.q_proj.weight": normal(q_size * (2 if hybrid else 1), hidden),
                    prefix + "self_attn.k_proj.weight": normal(kv_size, hidden),
                    prefix + "self_attn.v_proj.weight": normal(kv_size, hidden),
                    prefix + "self_attn.o_proj.weight": normal(hidden, q_size),
                    prefix + "self_attn.q_norm.weight": norm(arch["head_dim"]),
                    prefix + "self_attn.k_norm.weight": norm(arch["head_dim"]),
                }
            )
        if "num_experts" in arch:
            tensors[prefix + "mlp.gate.weight"] = normal(arch["num_experts"], hidden)
            for expert in range(arch["num_experts"]):
                tensors.update(mlp(f"{prefix}mlp.experts.{expert}.", arch["moe_intermediate_size"]))
        else:
            tensors.update(mlp(prefix + "mlp.", arch["intermediate_size"]))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _linear_attention(prefix: str, arch: dict, normal: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Gated DeltaNet layer's tensors, under Qwen3.5's names."""
    hidden = arch["hidden_size"]
    key_size = arch["linear_num_key_heads"] * arch["linear_key_head_dim"]
    value_heads = arch["linear_num_value_heads"]
    value_size = value_heads * arch["linear_value_head_dim"]
    channels = 2 * key_size + value_size
    return {
        prefix + "in_proj_qkv.weight": normal(channels, hidden),
        prefix + "in_proj_z.weight": normal(value_size, hidden),
        prefix + "in_proj_b.weight": normal(value_heads, hidden),
        prefix + "in_proj_a.weight": normal(value_heads, hidden),
        prefix + "conv1d.weight": normal(channels, 1, arch["linear_conv_kernel_dim"]) * 5,
        prefix + "dt_bias": torch.ones(value_heads),
        prefix + "A_log": torch.linspace(0.0, 2.5, value_heads),  # decay rates A from 1 to e^2.5
        prefix + "norm.weight": torch.ones(arch["linear_value_head_dim"]),
        prefix + "out_proj.weight": normal(hidden, value_size),
    }
