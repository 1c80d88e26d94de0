"""P/D for a mixture-of-experts model (Qwen3-MoE layout, routed layers among dense ones) through the
router equals colocated serving, token for token, over NIXL and TCP (``make test-slow``):
KV blocks move as for a dense model; what differs is only the compatibility hash, which covers the
routing. Prompts of 1 token, one block and one block + 1, and longer ones; every hold ends."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.hf_models import SHAPES, build_hf_model
from tests.pd.cluster import Cluster, assert_disaggregated_like_colocated

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SHAPE = "qwen3moe-e8-top2-mlponly"
MAX_TOKENS = 8
BLOCK = 16  # the engines' default block size


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    lengths = [1, BLOCK, BLOCK + 1, 40, 130, 7]
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("moe")
    build_hf_model(*SHAPES[SHAPE][:1], dict(SHAPES[SHAPE][1]), folder)
    return str(folder)


@pytest.fixture(scope="module")
def expected(moe_model) -> list[str]:
    with LLM(moe_model, tokenizer=str(ensure_demo_model()), device="cpu", max_model_len=512) as llm:
        outputs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [output.outputs[0].text for output in outputs]


@pytest.mark.parametrize("transport", ["nixl", "tcp"])
def test_pd_of_a_moe_model_equals_colocated(transport, moe_model, expected, tmp_path):
    cluster = Cluster.start(tmp_path, transport, model=moe_model, router_flags=("--pd-min-prefill-tokens", "1"))
    try:
        assert_disaggregated_like_colocated(cluster, _prompts(), expected, MAX_TOKENS)
    finally:
        cluster.stop()
