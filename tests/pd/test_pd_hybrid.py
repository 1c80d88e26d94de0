"""P/D for a hybrid model (Qwen3.5: Gated DeltaNet layers and gated full attention) through the router
equals colocated serving, token for token, over NIXL and TCP (``make test-slow``). The decode engine
pulls the prompt's KV blocks and the request's state slot, as of the token before the last (the
prefill leg runs its last token alone and leaves the slot as it was; the decode computes that
token again): a state shipped as of the last token, or not shipped, changes the tokens. Prompts
of 1 token, one block and one block + 1, and longer ones; every hold ends. With the engines'
models in worker processes and async scheduling too (the slots and restores cross to the worker
in each step's message), and with both engines at two tensor-parallel ranks."""

from __future__ import annotations

import random
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.hf_models import SHAPES, build_hf_model
from pdserve.testing.metrics import scrape
from tests.pd.cluster import Cluster, assert_disaggregated_like_colocated, post, wait_for

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
# Both engines at two ranks: each decode rank pulls its KV heads and its own share of the state slot
# (its value heads') from the prefill rank that holds the same share.
TWO_RANKS = ("--tensor-parallel-size", "2", "--kv-side-channel-port", "0")


@pytest.mark.parametrize(
    ("transport", "flags"),
    [("nixl", ()), ("tcp", ()), ("nixl", WORKERS), ("tcp", TWO_RANKS)],
    ids=["nixl", "tcp", "nixl-workers", "tcp-P2-D2"],
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
        for engine in (*cluster.prefills, *cluster.decodes):  # every slot back: none held, none owned
            wait_for(lambda url=engine.url: scrape(url)["pdserve_state_slots_used"] == 0, 10, "slots to be freed")
            assert scrape(engine.url)["pdserve_state_slots_held_for_remote"] == 0
    finally:
        cluster.stop()


def test_an_expired_lease_and_an_abort_before_the_pull_free_the_state_slot(hybrid_model, expected, tmp_path):
    # The prefill holds for 3 s; this decode engine neither renews nor pulls before 4 s, so the lease
    # expires: the slot (with the blocks) is freed, and the late pull fails on the rows' new
    # generations, so decode recomputes. A client leaving the decode leg before its pull ends it
    # instead: the pull is cancelled and the prefill told to free, long before the lease.
    cluster = Cluster.start(
        tmp_path,
        "nixl",
        with_router=False,
        prefill_flags=("--kv-lease-seconds", "3"),
        decode_faults="delay_load=4,no_renew",
        model=hybrid_model,
    )
    prefill, decode = cluster.prefills[0].url, cluster.decodes[0].url
    prompt = _prompts()[5]  # 130 tokens
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    leg_body = {**body, "kv_transfer_params": {"do_remote_decode": True}}
    try:
        status, leg = post(prefill + "/v1/completions", leg_body)
        assert status == 200 and scrape(prefill)["pdserve_state_slots_held_for_remote"] == 1
        status, answer = post(decode + "/v1/completions", {**body, "kv_transfer_params": leg["kv_transfer_params"]})
        assert status == 200 and answer["choices"][0]["text"] == expected[5]
        after_expiry = scrape(prefill)
        assert after_expiry["pdserve_kv_lease_expirations_total"] == 1
        assert after_expiry["pdserve_state_slots_held_for_remote"] == after_expiry["pdserve_state_slots_used"] == 0
        assert scrape(decode)["pdserve_kv_transfer_failures_total"] >= 1  # the late pull saw new generations

        status, leg = post(prefill + "/v1/completions", leg_body)
        assert status == 200
        left = time.monotonic()
        with pytest.raises(OSError):  # the client gives up while the decode leg waits for its pull
            post(decode + "/v1/completions", {**body, "kv_transfer_params": leg["kv_transfer_params"]}, timeout=0.5)
        wait_for(lambda: scrape(prefill)["pdserve_state_slots_used"] == 0, 10, "the abandoned leg's slot released")
        assert time.monotonic() - left < 3  # released, not expired
        assert scrape(prefill)["pdserve_kv_lease_expirations_total"] == 1
        wait_for(lambda: scrape(decode)["pdserve_state_slots_used"] == 0, 10, "the decode's slot freed")
    finally:
        cluster.stop()
