"""P/D between engines of different tensor-parallel sizes, through the router, equals colocated serving
at TP 1 token for token: each decode rank pulls exactly its KV heads from the prefill ranks that hold
them (NIXL reads per head slice, or TCP reads of them), and every prefill rank frees its blocks.

Real clusters of processes: each engine's ranks are worker processes (gloo on CPU) with a transfer
agent each. Everything here runs in ``make test-slow`` (the default suite's TP-2 P/D smoke is
``pdserve serve --decode-tp 2`` in tests/server/test_cli_serve.py, and the rank agents' slicing over
NIXL and TCP in tests/kvtransfer/test_agent_tp.py): every pairing of TP 1 and 2 over both
transports, TP 4 on either side over TCP (a model with 4 KV heads), and a model with one KV head at
P TP2 -> D TP2 (each decode rank reads that head once, from one prefill rank).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.hf_models import SHAPES, build_hf_model
from pdserve.testing.metrics import scrape
from tests.pd.cluster import Cluster, assert_a_cached_prefix_is_not_pulled_again, post, wait_for

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 6


def _prompts() -> list[list[int]]:
    rng = random.Random(23)
    prefix = [rng.randrange(10, 1000) for _ in range(64)]
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randrange(40, 200))] for _ in range(4)]
    return prompts + [prefix + [rng.randrange(10, 1000) for _ in range(rng.randrange(5, 80))] for _ in range(4)]


@pytest.fixture(scope="module")
def expected() -> list[str]:
    with LLM(str(ensure_demo_model()), device="cpu", max_model_len=512, num_kv_blocks=256) as llm:
        outputs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [output.outputs[0].text for output in outputs]


def _tp(size: int) -> tuple[str, ...]:
    # Rank r listens on the side-channel port + r: free ports each instead, so no neighbour's is taken.
    return ("--tensor-parallel-size", str(size), "--kv-side-channel-port", "0") if size > 1 else ()


PAIRINGS = [
    pytest.param(("nixl", 1, 2), id="nixl-P1-D2", marks=pytest.mark.slow),
    pytest.param(("nixl", 2, 1), id="nixl-P2-D1", marks=pytest.mark.slow),
    pytest.param(("nixl", 2, 2), id="nixl-P2-D2", marks=pytest.mark.slow),
    pytest.param(("tcp", 1, 2), id="tcp-P1-D2", marks=pytest.mark.slow),
    pytest.param(("tcp", 2, 1), id="tcp-P2-D1", marks=pytest.mark.slow),
    pytest.param(("tcp", 2, 2), id="tcp-P2-D2", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=PAIRINGS)
def cluster(request, tmp_path_factory):
    transport, prefill_tp, decode_tp = request.param
    folder = tmp_path_factory.mktemp(f"{transport}-p{prefill_tp}-d{decode_tp}")
    cluster = Cluster.start(folder, transport, prefill_flags=_tp(prefill_tp), decode_flags=_tp(decode_tp))
    yield cluster
    cluster.stop()


def _complete(cluster: Cluster, prompt: list[int]) -> str:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, answer = post(cluster.router.url + "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["text"]


def _assert_everything_pulled_and_freed(cluster: Cluster) -> None:
    decode = scrape(cluster.decodes[0].url)
    assert decode["pdserve_kv_transfer_bytes_total"] > 0 and decode["pdserve_kv_transfer_failures_total"] == 0
    router = scrape(cluster.router.url)
    assert router['pdserve_router_requests_total{path="fallback"}'] == 0
    # Every prefill rank's hold ended (released by every decode rank, not by the lease): blocks freed.
    prefill_url = cluster.prefills[0].url
    wait_for(lambda: scrape(prefill_url)["pdserve_kv_blocks_held_for_remote"] == 0, 10, "prefill holds to end")
    prefill = scrape(prefill_url)
    assert prefill["pdserve_kv_lease_expirations_total"] == 0


def test_pd_across_tensor_parallel_sizes_equals_colocated(cluster, expected):
    assert [_complete(cluster, prompt) for prompt in _prompts()] == expected
    _assert_everything_pulled_and_freed(cluster)


def test_a_prefix_cached_on_a_split_decode_is_not_pulled_again(cluster):
    assert_a_cached_prefix_is_not_pulled_again(cluster.decodes[0].url, lambda prompt: _complete(cluster, prompt))


# name -> (transport, prefill TP, decode TP, model shape): TP 4 splits 4 KV heads one per rank.
SPLIT_MODELS = {
    "tcp-P4-D1-4kv": ("tcp", 4, 1, "llama-mha-untied"),
    "tcp-P1-D4-4kv": ("tcp", 1, 4, "llama-mha-untied"),
    "tcp-P2-D2-1kv": ("tcp", 2, 2, "qwen3-linear-rope"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SPLIT_MODELS)
def test_pd_at_four_ranks_and_with_a_replicated_kv_head_equals_colocated(name, tmp_path):
    import json

    transport, prefill_tp, decode_tp, shape = SPLIT_MODELS[name]
    family, overrides = SHAPES[shape]
    build_hf_model(family, dict(overrides), tmp_path / "model")
    model = str(tmp_path / "model")
    settings = dict(tokenizer=str(ensure_demo_model()), device="cpu", max_model_len=512, num_kv_blocks=256)
    with LLM(model, **settings) as llm:
        outputs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    expected = [output.outputs[0].text for output in outputs]
    cluster = Cluster.start(
        tmp_path, transport, prefill_flags=_tp(prefill_tp), decode_flags=_tp(decode_tp), model=model
    )
    try:
        assert [_complete(cluster, prompt) for prompt in _prompts()] == expected
        _assert_everything_pulled_and_freed(cluster)
        # Each decode rank read each of its KV heads exactly once: the bytes pulled are the blocks'
        # bytes on every decode rank, no more (a replicated head read from both prefill ranks doubles them).
        config = json.loads((tmp_path / "model" / "config.json").read_text())
        kv_heads = config["num_key_value_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        heads_per_decode_rank = max(1, kv_heads // decode_tp)
        block_bytes = config["num_hidden_layers"] * 2 * heads_per_decode_rank * 16 * head_dim * 4
        pulled = scrape(cluster.decodes[0].url)["pdserve_kv_transfer_bytes_total"]
        assert pulled > 0 and pulled % (decode_tp * block_bytes) == 0, (pulled, block_bytes)
        at_most = sum(-(-len(prompt) // 16) for prompt in _prompts())  # every prompt block pulled once
        assert pulled <= decode_tp * block_bytes * at_most < 2 * pulled
    finally:
        cluster.stop()


def _descendants(pid: int) -> list[int]:
    import subprocess

    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in children] + [grand for child in children for grand in _descendants(int(child))]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nixl", "tcp"])
def test_a_prefill_rank_killed_while_decode_waits_to_pull_makes_decode_recompute_and_leaks_nothing(transport, tmp_path):
    import os
    import signal
    import threading

    prompt = _prompts()[1]
    with LLM(str(ensure_demo_model()), device="cpu", max_model_len=512, num_kv_blocks=256) as llm:
        [output] = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    # Decode starts each pull 3 s late, so the prefill rank can be killed while the request waits for it.
    cluster = Cluster.start(
        tmp_path,
        transport,
        prefill_flags=_tp(2),
        decode_flags=("--kv-transfer-timeout", "2"),
        decode_faults="delay_load=3",
    )
    try:
        answers: list[str] = []
        client = threading.Thread(target=lambda: answers.append(_complete(cluster, prompt)))
        client.start()
        prefill = cluster.prefills[0]
        wait_for(lambda: scrape(prefill.url).get("pdserve_kv_blocks_held_for_remote", 0) > 0, 30, "the prefill leg")
        [rank_1] = [
            pid
            for pid in _descendants(prefill.process.pid)
            if "steps-1" in Path(f"/proc/{pid}/cmdline").read_text()  # the worker of rank 1
        ]
        os.kill(rank_1, signal.SIGKILL)
        client.join(60)
        assert answers == [output.outputs[0].text]  # computed on decode instead
        assert prefill.process.wait(30) != 0  # the prefill engine failed fast and exited
        decode = scrape(cluster.decodes[0].url)
        assert decode["pdserve_kv_transfer_failures_total"] >= 1
        wait_for(lambda: scrape(cluster.decodes[0].url)["pdserve_kv_cache_usage_ratio"] == 0, 30, "decode to free")
    finally:
        cluster.stop()
