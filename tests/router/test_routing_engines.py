"""Smart routing against real engines: 1 prefill + 2 decode `pdserve` processes (small KV caches: 128 blocks of
16 tokens) and a `pdserve router --tokenizer` process, started once for the module. In order:

(c) requests sharing a prefix land on the decode pod that caches it, and the prefix hits the router predicted
    equal those the engines report (completions and chat: the router tokenizes and hashes as engines do);
(a) after enough distinct prompts to evict, the router's index equals every engine's cached blocks;
(b) a new router process converges to the same within the engines' snapshot interval;
(d) a decode engine killed mid-run is taken out and every request not yet streaming still succeeds.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request

import pytest

from pdserve.api.kv_events import SNAPSHOT_INTERVAL_S
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import scrape
from pdserve.testing.processes import Process, router_argv
from tests.pd.cluster import Cluster, free_port, post, wait_for

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
PREFIX_TOKENS = 13 * BLOCK


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def start_router(engines: Cluster, tmp_path) -> Process:
    port = free_port()
    argv = router_argv(
        port,
        [p.url for p in engines.prefills],
        [d.url for d in engines.decodes],
        "--tokenizer",
        str(ensure_demo_model()),
    )
    router = Process("router", argv, engines.prefills[0].env, port, str(tmp_path / f"router-{port}.log"))
    router.start()
    router.wait_healthy(60)
    return router


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = tmp_path_factory.mktemp("routing")
    cluster = Cluster.start(path, "nixl", 1, 2, with_router=False)
    try:
        cluster.router = start_router(cluster, path)
        cluster.path = path
        yield cluster
    finally:
        cluster.stop()


def complete(router: Process, prompt, max_tokens: int = 4, **extra) -> dict:
    status, answer = post(
        router.url + "/v1/completions",
        {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
    )
    assert status == 200, answer
    return answer


def index_differences(router: Process, engines: list[Process], stale_too: bool = True) -> list[str]:
    """How the router's index differs from the engines' caches (nothing when equal); with ``stale_too``, a pod
    still waiting for a snapshot counts as different."""
    index = get_json(router.url + "/debug/index?hashes=1")["pods"]
    differences = []
    for engine in engines:
        truth = get_json(engine.url + "/debug/cached_blocks")
        pod = index.get(engine.url)
        if pod is None:
            differences.append(f"{engine.name}: not in the index")
            continue
        believed, cached = set(pod["block_hashes"]), set(truth["block_hashes"])
        if (stale_too and pod["stale"]) or believed != cached:
            differences.append(
                f"{engine.name}: stale={pod['stale']} seq={pod['seq']}, {len(believed - cached)} "
                f"believed but not cached, {len(cached - believed)} cached but not known "
                f"(of {len(cached)})"
            )
        assert pod["block_size"] == truth["block_size"] == BLOCK
    return differences


def converge(router: Process, engines: list[Process], timeout: float, message: str, stale_too: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while differences := index_differences(router, engines, stale_too):
        assert time.monotonic() < deadline, f"{message}: {differences}"
        time.sleep(0.1)


def test_same_prefix_lands_where_it_is_cached_and_predictions_come_true(engines):
    rng = random.Random(1)
    router = engines.router
    prefixes = [[rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(4)]
    for prefix in prefixes:
        answers = [
            complete(router, prefix + [rng.randrange(10, 1000) for _ in range(rng.randrange(40, 80))]) for _ in range(4)
        ]
        # The first computes the prefix somewhere; the others land where it is (their decode pod has it all).
        assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX_TOKENS for a in answers[1:])
    system = {"role": "system", "content": "You are a terse assistant. " * 14}
    for question in ("What is a block?", "What is a prefix?", "What is a router?"):
        status, answer = post(
            router.url + "/v1/chat/completions",
            {"model": "demo", "messages": [system, {"role": "user", "content": question}], "max_tokens": 4},
        )
        assert status == 200, answer
    values = scrape(router.url)
    for role in ("prefill", "decode"):
        predicted = values[f'pdserve_router_prefix_blocks_predicted_total{{role="{role}"}}']
        realised = values[f'pdserve_router_prefix_blocks_realised_total{{role="{role}"}}']
        assert predicted == realised, (role, predicted, realised)
    assert values['pdserve_router_prefix_blocks_realised_total{role="decode"}'] >= 4 * 3 * 13
    assert values["pdserve_router_prefill_skipped_total"] >= 4 * 3  # the follow-ups had < 256 tokens left
    assert values['pdserve_router_requests_total{path="disagg"}'] >= 4


def test_the_index_equals_the_engines_caches_after_evictions(engines):
    rng = random.Random(2)
    first = [rng.randrange(10, 1000) for _ in range(300)]
    prompts = [first] + [[rng.randrange(10, 1000) for _ in range(rng.randrange(260, 400))] for _ in range(17)]
    errors: list[BaseException] = []

    def worker(part: list[list[int]]) -> None:
        try:
            for prompt in part:
                complete(engines.router, prompt, max_tokens=6)
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    complete(engines.router, first)
    threads = [threading.Thread(target=worker, args=(prompts[i::3],)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    # 18 prompts of 16+ blocks each went through the prefill engine's 128 blocks: the first one is gone there.
    truth = set(get_json(engines.prefills[0].url + "/debug/cached_blocks")["block_hashes"])
    from pdserve.engine.block_hash import hash_prompt_blocks

    assert hash_prompt_blocks(first, BLOCK)[0].hex() not in truth
    # Events alone keep the index exact (a router that joined mid-stream also waits for a snapshot to be sure).
    everyone = engines.prefills + engines.decodes
    converge(engines.router, everyone, 2, "the router's index differs from the caches", stale_too=False)
    converge(engines.router, everyone, SNAPSHOT_INTERVAL_S + 2, "the router's index stayed stale")


def test_a_new_router_converges_within_the_snapshot_interval(engines):
    engines.router.stop()
    engines.router = start_router(engines, engines.path)
    started = time.monotonic()
    converge(
        engines.router,
        engines.prefills + engines.decodes,
        SNAPSHOT_INTERVAL_S + 3,
        "a new router's index did not converge",
    )
    assert time.monotonic() - started < SNAPSHOT_INTERVAL_S + 3


def test_a_killed_decode_engine_is_taken_out_and_requests_still_succeed(engines):
    rng = random.Random(3)
    router = engines.router
    statuses: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker(seed: int) -> None:
        local = random.Random(seed)
        while not stop.is_set():
            prompt = [local.randrange(10, 1000) for _ in range(local.randrange(100, 450))]  # both paths
            status, _ = post(
                router.url + "/v1/completions", {"model": "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0}
            )
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=worker, args=(rng.random(),)) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(statuses) >= 4, 30, "no traffic")
    engines.decodes[1].kill()
    killed_at = len(statuses)
    wait_for(lambda: len(statuses) >= killed_at + 12, 60, "traffic stopped after the kill")
    stop.set()
    for thread in threads:
        thread.join(60)
    assert statuses and set(statuses) == {200}, statuses  # whole answers: nothing was streamed, so all retried
    values = scrape(router.url)
    assert values["pdserve_router_pod_ejections_total"] >= 1
    assert values["pdserve_router_retries_total"] >= 1  # requests that met the dead pod went to the live one
    index = get_json(router.url + "/debug/index")
    assert engines.decodes[0].url in index["pods"]
