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
from pdserve.testing.metrics import scrape
from tests.pd.cluster import Cluster, post, wait_for

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
        got = []
        for prompt in _prompts():
            body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            status, answer = post(cluster.router.url + "/v1/completions", body)
            assert status == 200, answer
            got.append(answer["choices"][0]["text"])
        assert got == expected
        router = scrape(cluster.router.url)
        assert router['pdserve_router_requests_total{path="disagg"}'] == len(_prompts())
        decode = scrape(cluster.decodes[0].url)
        assert decode["pdserve_kv_transfer_bytes_total"] > 0 and decode["pdserve_kv_transfer_failures_total"] == 0
        prefill_url = cluster.prefills[0].url
        wait_for(lambda: scrape(prefill_url)["pdserve_kv_blocks_held_for_remote"] == 0, 10, "prefill holds to end")
        assert scrape(prefill_url)["pdserve_kv_lease_expirations_total"] == 0
    finally:
        cluster.stop()
