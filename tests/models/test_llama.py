"""The Llama family (``models/llama.py``) against transformers' LlamaForCausalLM on the same seeded
weights: the logits at every position of a prompt agree, with our reference ops and with the packed
CPU kernels the engine runs."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu_kernels import cpu_ops
from pdserve.kernels.metadata import build_attention_metadata
from pdserve.models import llama
from pdserve.models.config import ModelConfig
from pdserve.models.loader import load_model
from pdserve.testing.hf_models import SHAPES, VOCAB
from pdserve.worker.kv_cache import allocate_kv_cache, layer_caches

LLAMA_SHAPES = [name for name, (family, _) in SHAPES.items() if family == "Llama"]
PROMPT_LEN, BLOCK_SIZE = 37, 8
# Both float32, differing in summation order only: at most 2.8e-5 apart on logits up to 7 (measured on these shapes).
LOGIT_ATOL = 1e-4


def _our_logits(model, config: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Our logits at every position of ``ids``, one sequence prefilled from an empty cache."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    kv_cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    metadata = build_attention_metadata([len(ids)], [len(ids)], [list(range(num_blocks))], BLOCK_SIZE)
    with torch.no_grad():
        hidden = model(ids, torch.arange(len(ids)), layer_caches(config, kv_cache, []), metadata)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("name", LLAMA_SHAPES)
def test_llama_logits_equal_transformers(name, hf_models):
    folder, hf = hf_models[name]
    config = ModelConfig.from_folder(folder)
    assert config.family is llama.FAMILY
    ids = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    model = load_model(folder, config, torch.float32, torch.device("cpu"), 64)
    diffs = {"reference": (_our_logits(model, config, ids) - expected).abs().max().item()}
    if cpu_ops() is not None:
        model.pack_for_cpu()
        diffs["packed"] = (_our_logits(model, config, ids) - expected).abs().max().item()
    print(f"{name}: max |logit difference| {diffs}")
    assert max(diffs.values()) < LOGIT_ATOL, diffs
