"""P/D for a hybrid model (Qwen3.5: Gated DeltaNet layers and gated full attention) through the router
equals colocated serving, token for token, over NIXL and TCP (``make test-slow``). The decode engine
pulls the prompt's KV blocks and the request's state slot, as of the token before the last (the
prefill leg runs its last token alone and leaves the slot as it was; the decode computes that
token again): a state shipped as of the last token, or not shipped, changes the tokens. Prompts
of 1 token, one block and one block + 1, and longer ones; every hold ends. With the engines'
models in worker processes and async scheduling too (the slots and restores cross to the worker
in each step's message)."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.hf_models import SHAPES, build_hf_model
from tests.pd.cluster import Cluster, assert_disaggregated_like_colocated

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SHAPE = "qwen3.5-hybrid"
MAX_TOKENS = 8
BLOCK = 16  # the engines' default block size


def _prompts() -> list[list[int]]:
    rng = random.Random(12)
    lengths = [1, 2, BLOCK, BLOCK + 1, 40, 130, 7]
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("hybrid")
    build_hf_model(*SHAPES[SHAPE], folder)
    return str(folder)


@pytest.fixture(scope="module")
def expected(hybrid_model) -> list[str]:
    with LLM(hybrid_model, tokenizer=str(ensure_demo_model()), device="cpu", max_model_len=512) as llm:
        outputs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [output.outputs[0].text for output in outputs]


WORKERS = ("--distributed-executor-backend", "mp", "--async-scheduling")


@pytest.mark.parametrize(
    ("transport", "flags"), [("nixl", ()), ("tcp", ()), ("nixl", WORKERS)], ids=["nixl", "tcp", "nixl-workers"]
)
def test_pd_of_a_hybrid_model_equals_colocated(transport, flags, hybrid_model, expected, tmp_path):
    cluster = Cluster.start(
        tmp_path,
        transport,
        prefill_flags=flags,
        decode_flags=flags,
        model=hybrid_model,
        router_flags=("--pd-min-prefill-tokens", "1"),
    )
    try:
        assert_disaggregated_like_colocated(cluster, _prompts(), expected, MAX_TOKENS)
    finally:
        cluster.stop()
