"""Multi-turn P/D with peer reads (make test-slow), real processes with the deployment's keys (1 prefill, 2
decode, a router that tokenizes): the decode engine that answered turn 1 holds the turn, and turn 2's prefill
reads that history from it (the engines' metrics show the tokens read, not computed); every answer equals
colocated serving's. A prefill leg whose holder is gone (killed between the turns) computes the prompt and
answers the same."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest

from pdserve import LLM, SamplingParams
from pdserve.api.auth import RouterSigner
from pdserve.api.keys import load_router_signing
from pdserve.api.peer_kv import PrefixSource, prefix_source_params
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import scrape
from tests.pd.cluster import Cluster, post, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # three engines and a router: make test-slow

MAX_TOKENS = 40
BLOCK = 16
PEER_HITS = 'pdserve_kv_tier_hit_tokens_total{medium="peer"}'


def _turns() -> list[list[int]]:
    """Turn 1's prompt, and turn 2's new text (turn 2's prompt is turn 1's with its answer and this)."""
    rng = random.Random(23)
    return [[rng.randrange(10, 1000) for _ in range(300)], [rng.randrange(10, 1000) for _ in range(60)]]


@pytest.fixture(scope="module")
def colocated() -> tuple[list[int], list[int], list[str]]:
    """(turn 1's answer's token ids, turn 2's prompt, both answers' texts) as colocated serving makes them."""
    llm = LLM(str(ensure_demo_model()), device="cpu", max_model_len=1024, num_kv_blocks=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    first, new = _turns()
    answer = llm.generate([first], params)[0].outputs[0]
    second = first + list(answer.token_ids) + new
    return list(answer.token_ids), second, [answer.text, llm.generate([second], params)[0].outputs[0].text]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster.start(
        tmp_path_factory.mktemp("peer-reads"),
        "nixl",
        1,
        2,
        keys=True,
        # The demo model computes a block faster than it is read from a peer: reads are forced here (the bench
        # model's cost is what the rule weighs in bench/multiturn.py).
        prefill_flags=("--kv-transfer-timeout", "2", "--kv-peer-always-read"),
        router_flags=("--tokenizer", str(ensure_demo_model()), "--pd-min-prefill-tokens", "0"),
    )
    yield cluster
    cluster.stop()


def _complete(cluster: Cluster, prompt: list[int]) -> str:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    status, answer = post(cluster.router.url + "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["text"]


def test_the_next_turns_prefill_reads_the_history_from_the_decode_that_answered(cluster, colocated):
    _, second, expected = colocated
    first = _turns()[0]
    assert _complete(cluster, first) == expected[0]
    holder = next(d for d in cluster.decodes if scrape(d.url)["pdserve_kv_blocks_held_for_peers"] > 0)
    # Turn 1's prompt and answer, in whole blocks whose KV was computed (the last answer token's was not).
    held = (len(first) + MAX_TOKENS - 1) // BLOCK
    assert scrape(holder.url)["pdserve_kv_blocks_held_for_peers"] == -(-(len(first) + MAX_TOKENS) // BLOCK)
    # The router's index learns the decode's blocks from its KV events.
    wait_for(lambda: _indexed(cluster, holder) >= held, 10, "the decode's blocks in the router's index")
    prefill = cluster.prefills[0].url
    before = scrape(prefill)
    assert _complete(cluster, second) == expected[1]
    after = scrape(prefill)
    read = after[PEER_HITS] - before.get(PEER_HITS, 0)
    # The prefill had turn 1's prompt cached (its blocks but the last, partial one); the rest of the history
    # came from the decode: the prompt's last partial block and the answer's whole blocks.
    cached_before = len(first) // BLOCK * BLOCK
    assert read == held * BLOCK - cached_before, (read, held, cached_before)
    assert scrape(cluster.router.url)["pdserve_router_prefix_sources_total"] == 1
    assert scrape(holder.url)["pdserve_kv_peer_served_bytes_total"] > 0


def _indexed(cluster: Cluster, pod) -> int:
    with urllib.request.urlopen(cluster.router.url + "/debug/index", timeout=10) as response:
        return json.loads(response.read())["pods"][pod.url]["num_blocks"]


def _signed_post(cluster: Cluster, url: str, path: str, body: dict) -> dict:
    """POST ``body`` to the engine at ``url`` as the router would (signed for that engine)."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **cluster.router_header(url, path, data)}
    request = urllib.request.Request(url + path, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_a_prefill_whose_holder_is_gone_computes_the_prompt(cluster, colocated):
    _, second, expected = colocated
    prefill = cluster.prefills[0]
    with urllib.request.urlopen(prefill.url + "/health", timeout=10) as response:
        reader = json.loads(response.read())["engine_id"]
    victim = cluster.decodes[1]
    with urllib.request.urlopen(victim.url + "/health", timeout=10) as response:
        health = json.loads(response.read())
    victim.stop()  # the holder dies between the turns
    expires_at = time.time() + 60
    handle = "ab" * 16
    capability = RouterSigner(load_router_signing(cluster.keys / "all")).capability(
        reader, health["engine_id"], handle, expires_at
    )
    source = health["kv_peer_source"]
    prompt = [7, *second[1:]]  # not cached on the prefill engine: all of it would come from the holder
    params = {
        "do_remote_decode": True,
        "kv_prefix_source": prefix_source_params(
            PrefixSource(
                health["engine_id"],
                source["host"],
                tuple(source["ports"]),
                handle,
                len(prompt) // BLOCK * BLOCK,
                reader,
                expires_at,
                capability,
            )
        ),
    }
    body = {"model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": params}
    before = scrape(prefill.url)
    answer = _signed_post(cluster, prefill.url, "/v1/completions", body)
    assert answer["kv_transfer_params"]["do_remote_prefill"] is True  # a prefill leg's answer, as ever
    # No decode leg will pull it: free the hold now, as the router does for a leg whose client left.
    _signed_post(cluster, prefill.url, "/v1/kv_transfer/release", {"kv_transfer_params": answer["kv_transfer_params"]})
    after = scrape(prefill.url)
    assert after[PEER_HITS] == before[PEER_HITS]  # nothing was read
    skipped = 'pdserve_kv_tier_blocks_skipped_total{medium="peer",reason="read_failed"}'
    assert after[skipped] - before.get(skipped, 0) == (len(prompt) - 1) // BLOCK  # never the last token
    # And the same prompt through the router (to the decode left) answers as colocated serving does.
    assert _complete(cluster, second) == expected[1]
