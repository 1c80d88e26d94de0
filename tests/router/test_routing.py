"""Smart routing through a real router against stub engines that publish KV events over ZMQ: requests follow the
cached prefix (in an engine's pool or its KV tiers), predictions are counted against what engines report, the P/D
decider, subscriptions that follow pods, malformed frames, stale indexes, passive failure counting, retries before
the first byte, and session affinity."""

from __future__ import annotations

import time

import msgspec
import pytest

from pdserve.api.kv_events import EventSigner, TierEvents
from pdserve.api.tenancy import request_cache_salt
from pdserve.api.tokenizer import apply_chat_template, encode_prompt, load_tokenizer
from pdserve.engine.block_hash import hash_prompt_blocks
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import metric, parse, series
from tests.router.helpers import get, metrics_text, post, settles, stream_bytes, usage_event

SENTENCE = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def model() -> str:
    return str(ensure_demo_model())


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(model)


def publish_until(loop, stub, router, condition, **batch) -> None:
    """Publish a batch again and again until the router shows it (a SUB that connects late misses messages)."""
    deadline = time.monotonic() + 5
    while not condition(router.router.index.pods.get(stub.url)):
        assert time.monotonic() < deadline, "the router never saw the stub's KV events"
        loop.run(stub.publish(**batch))
        time.sleep(0.02)


def has(hashes):
    return lambda pod: pod is not None and set(hashes) <= pod.hashes


def test_requests_follow_the_cached_prefix_and_predictions_are_counted(loop, cluster, model, tokenizer):
    prefill = cluster.stub("prefill", events=True)
    first, second = cluster.stub("decode", events=True), cluster.stub("decode", events=True)
    router = cluster.router([prefill.url], [first.url, second.url], tokenizer=model, routing="prefix")
    text = SENTENCE * 10
    hashes = hash_prompt_blocks(encode_prompt(tokenizer, text), 16)  # 320 tokens: 19 blocks can hit
    publish_until(loop, second, router, has(hashes[:12]), snapshot=hashes[:12])
    publish_until(loop, prefill, router, has(hashes[:3]), snapshot=hashes[:3])
    second.cached_tokens, prefill.cached_tokens = 12 * 16, 3 * 16
    for _ in range(3):
        assert loop.run(post(router.url + "/v1/completions", {"prompt": text, "max_tokens": 8}))[0] == 200
    assert len(second.seen) == 3 and first.seen == []  # the same pod every time, though load would alternate
    body = {"prompt": text, "stream": True, "stream_options": {"include_usage": True}}
    status, _, payload = loop.run(post(router.url + "/v1/completions", body))
    assert status == 200 and payload.endswith(usage_event("/v1/completions", 192) + b"data: [DONE]\n\n")
    assert len(second.seen) == 4
    text_metrics = metrics_text(loop, router)
    assert metric(text_metrics, "pdserve_router_choices_total", role="decode", pod=second.url, policy="prefix") == 4
    assert metric(text_metrics, "pdserve_router_choices_total", role="prefill", pod=prefill.url, policy="prefix") == 4
    for role, blocks in (("decode", 12 * 4), ("prefill", 3 * 4)):
        assert metric(text_metrics, "pdserve_router_prefix_blocks_predicted_total", role=role) == blocks
        assert metric(text_metrics, "pdserve_router_prefix_blocks_realised_total", role=role) == blocks

    # Chat prompts are rendered by the model's template, exactly as the engine does.
    messages = [{"role": "system", "content": SENTENCE * 3}, {"role": "user", "content": SENTENCE * 4}]
    chat_hashes = hash_prompt_blocks(apply_chat_template(tokenizer, messages), 16, "tenant-1")
    publish_until(loop, first, router, has(chat_hashes), snapshot=chat_hashes)
    first.cached_tokens = None  # no usage: nothing to compare, nothing counted
    body = {"messages": messages, "max_tokens": 4, "cache_salt": "tenant-1"}
    assert loop.run(post(router.url + "/v1/chat/completions", body))[0] == 200
    assert len(first.seen) == 1
    body["cache_salt"] = "tenant-2"  # another tenant's hashes differ: nothing cached for it, least-loaded wins
    second.cached_tokens = 0
    assert loop.run(post(router.url + "/v1/chat/completions", body))[0] == 200
    assert len(first.seen) + len(second.seen) == 6
    text_metrics = metrics_text(loop, router)
    for name in ("pdserve_router_prefix_blocks_predicted_total", "pdserve_router_prefix_blocks_realised_total"):
        assert metric(text_metrics, name, role="decode") == 48  # only answers that report usage count


def test_tier_events_steer_requests_and_show_in_the_debug_index_and_metrics(loop, cluster, model, tokenizer):
    pool, disk, cold = (cluster.stub("decode", events=True) for _ in range(3))
    router = cluster.router([], [pool.url, disk.url, cold.url], tokenizer=model, api_key="sk")
    text = SENTENCE * 10
    # What an engine caches for a client with this key (its tenant's salt, pdserve/api/tenancy.py).
    hashes = hash_prompt_blocks(encode_prompt(tokenizer, text), 16, request_cache_salt("Bearer sk", None))
    publish_until(loop, pool, router, has(hashes), snapshot=hashes)
    on_disk = [TierEvents("disk", [], [], hashes), TierEvents("host", [], [], [])]
    publish_until(loop, disk, router, lambda pod: pod is not None and "disk" in pod.tiers, snapshot=[], tiers=on_disk)
    publish_until(loop, cold, router, lambda pod: pod is not None, snapshot=[])
    auth = {"Authorization": "Bearer sk"}
    body = {"prompt": text, "max_tokens": 2}
    for _ in range(2):
        assert loop.run(post(router.url + "/v1/completions", body, auth))[0] == 200
    assert (len(pool.seen), disk.seen, cold.seen) == (2, [], [])  # the pool hit beats the disk hit
    publish_until(loop, pool, router, lambda pod: not pod.hashes, removed=hashes)  # evicted
    for _ in range(2):
        assert loop.run(post(router.url + "/v1/completions", body, auth))[0] == 200
    assert (len(pool.seen), len(disk.seen), cold.seen) == (2, 2, [])  # the disk hit beats the cold pods

    status, payload = loop.run(get(router.url + "/debug/index?hashes=1", auth))
    pods = msgspec.json.decode(payload)["pods"]
    assert status == 200 and pods[disk.url]["num_blocks"] == 0
    assert pods[disk.url]["media"] == {"engine": 0, "host": 0, "disk": len(hashes)}
    assert pods[disk.url]["tier_block_hashes"]["disk"] == sorted(block.hex() for block in hashes)
    assert pods[pool.url]["media"] == {"engine": 0} and pods[pool.url]["tier_block_hashes"] == {}
    samples = parse(metrics_text(loop, router))
    medium_blocks = {
        (pod, medium): samples.get(series("pdserve_router_kv_index_medium_blocks", pod=pod, medium=medium))
        for pod in (pool.url, disk.url)
        for medium in ("engine", "host", "disk", "shared")
    }
    assert medium_blocks == {  # only the media a pod reports
        (pool.url, "engine"): 0,
        (pool.url, "host"): None,
        (pool.url, "disk"): None,
        (pool.url, "shared"): None,
        (disk.url, "engine"): 0,
        (disk.url, "host"): 0,
        (disk.url, "disk"): len(hashes),
        (disk.url, "shared"): None,
    }
    assert metric(samples, "pdserve_router_kv_index_blocks", pod=disk.url) == 0


def test_the_decider_skips_the_prefill_leg_when_decode_has_the_prompt(loop, cluster, model, tokenizer):
    prefill, decode = cluster.stub("prefill", events=True), cluster.stub("decode", events=True)
    router = cluster.router([prefill.url], [decode.url], tokenizer=model, pd_min_prefill_tokens=256)
    cached_text, new_text = SENTENCE * 10, "A different opening entirely. " + SENTENCE * 10
    hashes = hash_prompt_blocks(encode_prompt(tokenizer, cached_text), 16)
    publish_until(loop, decode, router, has(hashes), snapshot=hashes)
    assert loop.run(post(router.url + "/v1/completions", {"prompt": cached_text}))[0] == 200  # 320 - 304 < 256
    assert prefill.seen == [] and "kv_transfer_params" not in decode.seen[-1].body
    assert loop.run(post(router.url + "/v1/completions", {"prompt": "short"}))[0] == 200  # tiny: nothing to gain
    assert prefill.seen == []
    assert loop.run(post(router.url + "/v1/completions", {"prompt": new_text}))[0] == 200  # nothing cached
    assert len(prefill.seen) == 1 and "kv_transfer_params" in decode.seen[-1].body
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_prefill_skipped_total") == 2
    assert metric(text, "pdserve_router_requests_total", path="decode_only") == 2
    assert metric(text, "pdserve_router_requests_total", path="disagg") == 1


def test_subscriptions_follow_pods_and_the_debug_index_shows_them(loop, cluster, model):
    first, second = cluster.stub("decode", events=True), cluster.stub("decode", events=True)
    router = cluster.router([], [first.url, second.url], tokenizer=model, api_key="sk", health_interval=0.2)
    inner = router.router
    assert settles(lambda: len(inner.subscriber.endpoints()) == 2)
    publish_until(loop, first, router, has([b"a" * 32]), stored=[b"a" * 32])
    publish_until(loop, second, router, has([b"b" * 32]), snapshot=[b"b" * 32])
    auth = {"Authorization": "Bearer sk"}
    assert loop.run(get(router.url + "/debug/index"))[0] == 401  # behind the API key, like /v1
    status, payload = loop.run(get(router.url + "/debug/index?hashes=1", auth))
    pods = msgspec.json.decode(payload)["pods"]
    assert status == 200 and pods[second.url]["block_hashes"] == [(b"b" * 32).hex()]
    assert pods[second.url]["num_blocks"] == 1 and not pods[second.url]["stale"]
    assert pods[second.url]["load"]["num_running"] == 0 and pods[second.url]["block_size"] == 16
    assert pods[first.url]["num_blocks"] == 1

    # A seq gap: stale (and said so in the metrics) until the next snapshot.
    loop.run(second.publish(stored=[b"c" * 32], seq=second.seq + 5))
    assert settles(lambda: inner.index.pods[second.url].stale)
    assert metric(metrics_text(loop, router), "pdserve_router_kv_index_stale", pod=second.url) == 1
    publish_until(loop, second, router, lambda pod: not pod.stale, snapshot=[b"d" * 32])
    assert inner.index.pods[second.url].hashes == {b"d" * 32}

    # Malformed frames are dropped and counted; the subscription carries on.
    loop.run(second.send_raw(b"not msgpack"))
    loop.run(second.send_raw(b"two", b"frames"))
    assert settles(lambda: metric(metrics_text(loop, router), "pdserve_router_kv_events_malformed_total") == 2)
    publish_until(loop, second, router, has([b"e" * 32]), stored=[b"e" * 32])

    # An engine restarted on the same pod publishes on a new port: followed there, its old picture dropped.
    old = inner.subscriber.endpoints()[first.url]
    loop.run(first.rebind_events())
    assert settles(lambda: inner.subscriber.endpoints().get(first.url) not in (None, old))
    assert first.url not in inner.index.pods
    publish_until(loop, first, router, has([b"f" * 32]), stored=[b"f" * 32])

    # A pod that leaves (discovery) is unsubscribed and forgotten, its per-pod series too.
    async def leave() -> None:
        inner._apply_snapshot({"prefill": [], "decode": [first.url]})

    loop.run(leave())
    assert list(inner.subscriber.endpoints()) == [first.url] and second.url not in inner.index.pods
    assert second.url not in metrics_text(loop, router)


def test_three_failures_in_a_row_take_a_pod_out_until_its_probe_passes(loop, cluster):
    bad, good = cluster.stub("decode"), cluster.stub("decode")
    bad.status = 500
    router = cluster.router([], [bad.url, good.url], routing="round-robin", health_interval=60)
    statuses = [loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}))[0] for _ in range(8)]
    assert statuses == [500, 200, 500, 200, 500, 200, 200, 200]  # 5xx answers pass on; the third ejects
    assert len(bad.seen) == 3
    assert metric(metrics_text(loop, router), "pdserve_router_pod_ejections_total") == 1
    loop.run(router.router._health.check_all())  # /health still answers 200: back in rotation
    bad.status = 200
    for _ in range(2):
        loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}))
    assert len(bad.seen) == 4 and router.router.decode.pods[0].failures == 0


def test_a_stream_that_breaks_before_its_first_byte_goes_to_another_pod(loop, cluster):
    broken, good = cluster.stub("decode"), cluster.stub("decode")
    broken.die_after = 0  # headers, then the connection drops
    router = cluster.router([], [broken.url, good.url], routing="round-robin", health_interval=60)
    for _ in range(2):
        status, _, payload = loop.run(post(router.url + "/v1/completions", {"prompt": "hi", "stream": True}))
        assert status == 200 and payload == stream_bytes("/v1/completions", 8)
    assert len(broken.seen) == len(good.seen) == 2  # round-robin tries the broken pod first both times
    text = metrics_text(loop, router)
    assert metric(text, "pdserve_router_retries_total") == 2
    assert metric(text, "pdserve_router_errors_total", kind="decode_unreachable") == 2
    assert router.router.decode.pods[0].failures == 2 and router.router.decode.pods[0].healthy
    assert metric(text, "pdserve_router_choices_total", role="decode", pod=good.url, policy="round-robin") == 2


def test_session_affinity_keeps_a_session_on_one_pod(loop, cluster):
    pods = [cluster.stub("decode") for _ in range(3)]
    router = cluster.router([], [pod.url for pod in pods], session_affinity=True)

    def landed(headers=None, **body) -> int:
        before = [len(pod.seen) for pod in pods]
        assert loop.run(post(router.url + "/v1/completions", {"prompt": "hi", **body}, headers))[0] == 200
        return next(i for i, pod in enumerate(pods) if len(pod.seen) > before[i])

    for session in ("alpha", "beta", "gamma"):
        assert len({landed({"X-Session-Id": session}) for _ in range(4)}) == 1
    assert len({landed(user="someone") for _ in range(4)}) == 1
    assert len({landed() for _ in range(3)}) == 3  # no session: least-load spreads them
    text = metrics_text(loop, router)
    assert (
        sum(metric(text, "pdserve_router_choices_total", role="decode", pod=pod.url, policy="affinity") for pod in pods)
        == 16
    )


def test_long_prompts_are_tokenized_off_the_event_loop(loop, cluster, model, tokenizer):
    decode = cluster.stub("decode", events=True)
    router = cluster.router([], [decode.url], tokenizer=model)
    text = SENTENCE * 200  # 9 KB: the worker thread
    hashes = hash_prompt_blocks(encode_prompt(tokenizer, text), 16)[:4]
    publish_until(loop, decode, router, has(hashes), snapshot=hashes)
    decode.cached_tokens = 64
    assert loop.run(post(router.url + "/v1/completions", {"prompt": text}))[0] == 200
    text_metrics = metrics_text(loop, router)
    assert metric(text_metrics, "pdserve_router_prefix_blocks_predicted_total", role="decode") == 4
    assert metric(text_metrics, "pdserve_router_prefix_blocks_realised_total", role="decode") == 4


def test_several_prompts_and_bad_chat_arguments_route_without_the_prompt(loop, cluster, model):
    decode = cluster.stub("decode", events=True)
    router = cluster.router([], [decode.url], tokenizer=model)
    for path, body in (
        ("/v1/completions", {"prompt": ["a", "b"]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": "surprise"}},
        ),
    ):
        assert loop.run(post(router.url + path, body))[0] == 200
    assert len(decode.seen) == 2


def test_events_relayed_from_another_pod_replayed_or_signed_for_another_engine_are_refused(
    loop, cluster, model, tmp_path
):
    # Before (dbd1dc4): an event's signature named no engine and had no order, so any engine's signed stream (anyone
    # may subscribe) relayed under another pod's address, or an old batch sent again, was taken: the router credited
    # pod B with pod A's cache. Now a batch must name the engine the pod's /health names, with a newer seq.
    from pdserve.api.keys import EVENTS_KEY, ROUTER_FILES, load_secret, new_bundle, write_bundle

    write_bundle(tmp_path, new_bundle(), ROUTER_FILES)
    signer = EventSigner(load_secret(tmp_path, EVENTS_KEY))  # what every engine of the deployment holds
    first, second = (
        cluster.stub("decode", events=True, signer=signer),
        cluster.stub("decode", events=True, signer=signer),
    )
    router = cluster.router([], [first.url, second.url], tokenizer=model, health_interval=0.2, keys_dir=str(tmp_path))
    inner = router.router
    assert settles(lambda: len(inner.subscriber.endpoints()) == 2)
    publish_until(loop, first, router, has([b"a" * 32]), snapshot=[b"a" * 32])
    publish_until(loop, second, router, has([b"b" * 32]), snapshot=[b"b" * 32])

    def malformed() -> float:
        return metric(metrics_text(loop, router), "pdserve_router_kv_events_malformed_total")

    # First's batch, signed and fresh, relayed by the second pod (or sent from its address by anyone):
    loop.run(second.publish(snapshot=[b"x" * 32], engine_id=first.engine_id, seq=first.seq + 1))
    # an old batch of the second pod's own, sent again:
    loop.run(second.publish(snapshot=[b"y" * 32], seq=0))
    # a batch made with the events key by an engine (any holds it) in the second one's name, from the first pod:
    loop.run(first.publish(snapshot=[b"z" * 32], engine_id=second.engine_id, seq=second.seq + 10))
    assert settles(lambda: malformed() == 3)
    assert inner.index.pods[second.url].hashes == {b"b" * 32} and inner.index.pods[first.url].hashes == {b"a" * 32}
    # The real streams carry on.
    publish_until(loop, second, router, has([b"c" * 32]), stored=[b"c" * 32])


def test_two_router_replicas_keep_a_session_on_the_same_pod(loop, cluster):
    """Replicas behind one Service share no state: each session lands on the pod a rendezvous hash of it gives,
    whichever replica the client reaches (a restarted replica too: it keeps nothing the hash needs)."""
    pods = [cluster.stub("decode") for _ in range(4)]
    replicas = [cluster.router([], [pod.url for pod in pods], session_affinity=True) for _ in range(2)]

    def landed(router, session: str) -> int:
        before = [len(pod.seen) for pod in pods]
        headers = {"X-Session-Id": session}
        assert loop.run(post(router.url + "/v1/completions", {"prompt": "hi"}, headers))[0] == 200
        return next(i for i, pod in enumerate(pods) if len(pod.seen) > before[i])

    for session in ("alpha", "beta", "gamma", "delta", "epsilon"):
        assert len({landed(router, session) for router in replicas for _ in range(2)}) == 1
