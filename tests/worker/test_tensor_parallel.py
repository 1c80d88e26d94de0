"""Tensor parallelism on CPU (gloo, one worker process per rank; 2 ranks here, 4 in make test-slow): a model
split over ranks computes what it computes whole, token for token, with logprobs within 1e-4, through chunked prefill,
preemption and prefix-cache hits; for GQA (KV heads split), MQA (the one KV head replicated), q/k/v
biases, tied and untied LM heads, a vocabulary that does not split evenly, and experts (each expert's
intermediate features split, routed layers among dense ones). A split that cannot be
made is refused at start-up, naming why."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.build import build_engine_core
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.hf_models import SHAPES, build_hf_model

pytestmark = pytest.mark.timeout(600)

# name -> (family, overrides): GQA with the KV heads split; MQA replicated; biases; an odd, untied vocabulary.
MODELS = {
    "qwen3-gqa2-headdim": SHAPES["qwen3-gqa2-headdim"],
    "qwen3-mqa-replicated": SHAPES["qwen3-linear-rope"],
    "qwen2-gqa2-bias": SHAPES["qwen2-gqa2-bias"],
    "llama-mha-untied-odd-vocab": ("Llama", {"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1021}),
    "qwen3moe-e8-top2-mlponly": SHAPES["qwen3moe-e8-top2-mlponly"],
    # Hybrid: linear-attention key and value heads (and their state slots) split, a shared expert's features too.
    "qwen3.5-moe-e8-top2-shared": SHAPES["qwen3.5-moe-e8-top2-shared"],
}


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(1, 1000) for _ in range(40)]
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(5, 90))] for _ in range(6)] + [
        shared + [rng.randrange(1, 1000) for _ in range(10)] for _ in range(2)
    ]


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    results = []
    for _ in range(2):  # the second round hits the prefix cache
        for output in llm.generate(_prompts(), params):
            choice = output.outputs[0]
            results.append(
                (choice.token_ids, [step[t].logprob for step, t in zip(choice.logprobs, choice.token_ids, strict=True)])
            )
    return results


@pytest.mark.parametrize(
    ("name", "size"),
    [
        *((name, 2) for name in MODELS),
        # Four ranks (make test-slow): KV heads split four ways, and two KV heads each replicated on two ranks.
        pytest.param("llama-mha-untied-odd-vocab", 4, marks=pytest.mark.slow),
        pytest.param("llama-gqa4-tied-llama3rope", 4, marks=pytest.mark.slow),
        pytest.param("qwen3moe-e16-top4-step2", 4, marks=pytest.mark.slow),
        pytest.param("qwen3.5-hybrid", 2, marks=pytest.mark.slow),
    ],
)
def test_split_ranks_compute_what_one_computes(name, size, tmp_path):
    family, overrides = MODELS.get(name) or SHAPES[name]
    build_hf_model(family, dict(overrides), tmp_path)
    # Small batches and cache: prompts are chunked and requests preempted.
    settings = dict(
        tokenizer=str(ensure_demo_model()),
        device="cpu",
        block_size=8,
        kv_cache_memory=1 << 20,
        max_num_batched_tokens=48,
    )
    with LLM(str(tmp_path), **settings) as whole:
        expected = _run(whole)
        preemptions = whole.engine.make_stats().num_preemptions
    with LLM(str(tmp_path), tensor_parallel_size=size, **settings) as split:
        assert len(split.engine.model_executor.processes) == size
        got = _run(split)
        assert split.engine.make_stats().num_preemptions == preemptions
    import torch  # after pdserve, which sets the OpenMP wait policy torch reads once

    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)


def test_preemption_and_long_chunked_prompts_at_two_ranks():
    prompts = ["word " * 150, "The quick brown fox", "The quick brown fox jumps over", [5, 6, 7, 8, 9] * 7]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1, n=2)
    settings = dict(device="cpu", num_kv_blocks=32, max_model_len=512, max_num_batched_tokens=128)

    def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
        return [
            (c.token_ids, [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)])
            for output in llm.generate(prompts, params)
            for c in output.outputs
        ]

    with LLM(str(ensure_demo_model()), **settings) as whole:
        expected = run(whole)
        preemptions = whole.engine.make_stats().num_preemptions
    with LLM(str(ensure_demo_model()), tensor_parallel_size=2, **settings) as split:
        got = run(split)
        assert split.engine.make_stats().num_preemptions == preemptions > 0
    import torch

    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)


def test_an_impossible_split_is_refused_at_start_up():
    with pytest.raises(ValueError, match="4 attention heads do not split over 3 ranks"):
        build_engine_core(EngineArgs(model=str(ensure_demo_model()), device="cpu", tensor_parallel_size=3))


def test_experts_that_cannot_split_are_refused(tmp_path):
    family, overrides = SHAPES["qwen3moe-e4-top1"]
    build_hf_model(family, {**overrides, "moe_intermediate_size": 42}, tmp_path)
    with pytest.raises(ValueError, match="an expert intermediate size of 42 does not split over 4 ranks"):
        build_engine_core(EngineArgs(model=str(tmp_path), device="cpu", tensor_parallel_size=4))


def test_linear_attention_heads_that_cannot_split_are_refused(tmp_path):
    family, overrides = SHAPES["qwen3.5-hybrid"]
    build_hf_model(family, {**overrides, "linear_num_key_heads": 1, "linear_num_value_heads": 3}, tmp_path)
    with pytest.raises(ValueError, match="1 linear-attention key heads do not split over 2 ranks"):
        build_engine_core(EngineArgs(model=str(tmp_path), device="cpu", tensor_parallel_size=2))


def test_a_rank_reads_only_its_own_slices_of_split_weights(monkeypatch, tmp_path):
    # Rank 1 of 2, loaded here without its peer (loading runs no collective): every split weight is read through
    # a slice of the memory-mapped file, never whole; only what every rank holds whole (norms, row-parallel
    # biases) is read whole; and the rank holds about half of the split parameters.
    from pdserve.models import loader
    from pdserve.models.config import ModelConfig
    from pdserve.models.parallel import TensorParallel

    build_hf_model(*SHAPES["qwen2-gqa2-bias"][:1], dict(SHAPES["qwen2-gqa2-bias"][1]), tmp_path)
    whole_reads: list[str] = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.file.get_tensor(name)

        def get_slice(self, name):
            return self.file.get_slice(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    config = ModelConfig.from_folder(str(tmp_path))
    import torch

    split = loader.load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64, TensorParallel(1, 2))
    assert whole_reads and all(name.endswith(("norm.weight", "o_proj.bias")) for name in whole_reads), whole_reads
    whole = loader.load_model(tmp_path, config, torch.float32, torch.device("cpu"), 64)
    split_params = sum(p.numel() for n, p in split.named_parameters() if "norm" not in n)
    whole_params = sum(p.numel() for n, p in whole.named_parameters() if "norm" not in n)
    assert split_params < 0.55 * whole_params
