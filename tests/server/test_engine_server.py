"""The colocated engine server on 127.0.0.1 (real core process, real sockets), driven by the
official openai client and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import scrape
from pdserve.worker.cpu_budget import choose_threads


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.running.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(server):
    return LLM(str(ensure_demo_model(server.cache_dir)), kv_cache_memory=64 << 20, max_model_len=512, device="cpu")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    with urllib.request.urlopen(server.running.url + "/health") as response:
        assert response.status == 200


def test_completions_equal_offline_greedy(client, offline):
    prompts = ["Hello there", "The router sends", "x"]
    expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    response = client.completions.create(
        model="demo", prompt=prompts, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [e.outputs[0].text for e in expected]
    assert response.usage.completion_tokens == 36
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)


def test_chat_streaming_and_not_agree(client, offline):
    messages = [{"role": "user", "content": "Say something"}]
    full = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert full.choices[0].message.content == expected[0].outputs[0].text
    assert full.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model="demo",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_thirty_two_concurrent_streams(client, offline):
    prompts = [f"Prompt number {i} says" for i in range(32)]
    expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    def stream(prompt: str) -> str:
        chunks = client.completions.create(
            model="demo", prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(stream, prompts))
    assert texts == [e.outputs[0].text for e in expected]


def test_stop_strings_n_and_logprobs(client):
    base = (
        client.completions.create(
            model="demo", prompt="Once upon", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    cut = client.completions.create(
        model="demo", prompt="Once upon", max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.text == base[: base.index(stop)] and cut.finish_reason == "stop"
    several = client.completions.create(
        model="demo",
        prompt="Once upon",
        max_tokens=6,
        temperature=1.0,
        n=3,
        seed=5,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == 6 and len(c.logprobs.top_logprobs[0]) == 2 for c in several.choices)
    echo = client.completions.create(
        model="demo",
        prompt="Once upon",
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert echo.text.startswith("Once upon") and echo.logprobs.token_logprobs[0] is None


def _post(server, path: str, body: bytes | str) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(server.running.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400),
    ("/v1/completions", "[]", 400),
    ("/v1/completions", '{"model": "demo"}', 400),
    ("/v1/completions", '{"prompt": "x", "max_tokens": "ten"}', 400),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 0}', 400),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 100000}', 400),
    ("/v1/completions", '{"prompt": "x", "temperature": -1}', 400),
    ("/v1/completions", '{"prompt": "x", "top_p": 0}', 400),
    ("/v1/completions", '{"prompt": "x", "n": 1000}', 400),
    ("/v1/completions", '{"prompt": "x", "logprobs": 50}', 400),
    ("/v1/completions", '{"prompt": [], "max_tokens": 2}', 400),
    ("/v1/completions", '{"prompt": [1, 99999999]}', 400),
    ("/v1/completions", '{"prompt": "x", "model": "other"}', 404),
    ("/v1/completions", json.dumps({"prompt": [5] * 600}), 400),
    ("/v1/completions", '{"prompt": "x", "stop": 7}', 400),
    ("/v1/completions", '{"prompt": "x", "presence_penalty": 5}', 400),
    ("/v1/completions", '{"prompt": "x", "priority": -1}', 400),  # this engine schedules fcfs
    ("/v1/completions", '{"prompt": "x", "priority": "high"}', 400),
    ("/v1/completions", '{"prompt": "x", "priority": 1e30}', 400),
    ("/v1/completions", '{"prompt": "x", "priority": 9223372036854775808}', 400),  # past 64 bits
    ("/v1/chat/completions", '{"messages": []}', 400),
    ("/v1/chat/completions", '{"messages": "hi"}', 400),
    ("/v1/chat/completions", '{"messages": [{"content": "no role"}]}', 400),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99, "logprobs": true}',
        400,
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}', 400),
    ("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413),
    ("/v1/nothing", "{}", 404),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status):
    code, payload = _post(server, path, body)
    assert code == status, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}


def test_server_still_serves_after_bad_requests(client):
    assert client.completions.create(model="demo", prompt="fine", max_tokens=2).choices[0].finish_reason


STARTUP_PHASES = ("load_weights", "profile_memory", "allocate_kv_cache", "warm_up")


def test_metrics_use_the_contract_names(server, client):
    client.completions.create(model="demo", prompt="count me", max_tokens=3, extra_body={"ignore_eos": True})
    values = scrape(server.running.url)
    for name in (
        "pdserve_num_requests_running",
        "pdserve_num_requests_waiting",
        "pdserve_num_requests_waiting_for_remote_kv",
        "pdserve_kv_cache_usage_ratio",
        "pdserve_kv_blocks_held_for_remote",
        "pdserve_prefix_cache_queries_total",
        "pdserve_prefix_cache_hits_total",
        "pdserve_preemptions_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "pdserve_time_to_first_token_seconds_count",
        "pdserve_time_per_output_token_seconds_count",
        "pdserve_e2e_request_latency_seconds_count",
    ):
        assert name in values, name
    assert values['pdserve_requests_total{finish_reason="length"}'] >= 1
    assert any(k.startswith("vllm:cache_config_info{") and 'cache_dtype="float32"' in k for k in values)
    # The start, phase by phase, each once: the phases fit inside the whole.
    phases = {name: values[f'pdserve_startup_phase_seconds{{phase="{name}"}}'] for name in STARTUP_PHASES}
    assert all(seconds >= 0 for seconds in phases.values())
    assert 0 < sum(phases.values()) <= values["pdserve_startup_seconds"]
    # The compute threads the engine chose from its CPU budget, and the cgroup's limits it saw (0: none).
    budget = choose_threads(None)
    assert values["pdserve_cpu_thread_budget"] == budget.threads
    assert 1 <= values["pdserve_cpu_compute_threads"] <= budget.threads  # the governor may hold fewer now
    assert values["pdserve_cpu_quota_cores"] == (budget.limits.cpu_quota or 0)
    assert values["pdserve_memory_limit_bytes"] == (budget.limits.memory_limit or 0)


def test_request_lengths_are_histograms_under_both_names(server, client):
    before = scrape(server.running.url)
    answer = client.completions.create(model="demo", prompt="how long", max_tokens=3, extra_body={"ignore_eos": True})
    after = scrape(server.running.url)
    prompt_tokens = answer.usage.prompt_tokens
    for prefix in ("pdserve_request", "vllm:request"):
        for kind, tokens in (("prompt", prompt_tokens), ("generation", 3)):
            name = f"{prefix}_{kind}_tokens"
            assert after[f"{name}_count"] - before.get(f"{name}_count", 0) == 1, name
            assert after[f"{name}_sum"] - before.get(f"{name}_sum", 0) == tokens, name
            # 1-2-5 buckets (cumulative): a length of at most 5 is counted in the bucket le="5.0".
            bucket = f'{name}_bucket{{le="5.0"}}'
            assert after[bucket] - before.get(bucket, 0) == (1 if tokens <= 5 else 0), name


def test_clients_that_disconnect_mid_stream_free_their_blocks(server):
    import http.client
    from urllib.parse import urlparse

    url = urlparse(server.running.url)
    body = json.dumps({"model": "demo", "prompt": "long story", "max_tokens": 400, "stream": True, "ignore_eos": True})
    for _ in range(20):
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        response.read1(64)  # some of the stream arrived: the request is running
        connection.close()  # gone mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        values = scrape(server.running.url)
        if (
            values["pdserve_num_requests_running"],
            values["pdserve_num_requests_waiting"],
            values["pdserve_kv_cache_usage_ratio"],
        ) == (0, 0, 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"blocks still held after the clients left: {values}")


def test_openapi_document_describes_the_endpoints(server):
    with urllib.request.urlopen(server.running.url + "/openapi.json") as response:
        document = json.loads(response.read())
    assert document["openapi"] == "3.1.0"
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(document["paths"])
    schemas = document["components"]["schemas"]
    request_ref = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert request_ref == {"$ref": "#/components/schemas/CompletionRequest"}
    assert "prompt" in schemas["CompletionRequest"]["required"]
    refs = json.dumps(document).count("#/components/schemas/")
    assert refs and all(
        ref.split("/")[-1] in schemas
        for ref in [part.split('"')[0] for part in json.dumps(document).split("#/components/schemas/")[1:]]
    )


def test_api_keys_are_tenants_whose_cached_prefixes_never_cross(server):
    """Two clients send the same 200-token prompt with different API keys (the engine checks none, as behind a
    router that does): the second computes everything; the first's key, and its own cache_salt under the same
    key, find what they cached; another key's cache_salt equal to the first key's salt text finds nothing."""
    prompt = list(range(100, 300))

    def cached(key: str, cache_salt: str | None = None) -> int:
        tenant = openai.OpenAI(base_url=server.running.url + "/v1", api_key=key, max_retries=0, timeout=60)
        extra = {"cache_salt": cache_salt} if cache_salt is not None else {}
        answer = tenant.completions.create(model="demo", prompt=prompt, max_tokens=1, extra_body=extra)
        details = answer.usage.prompt_tokens_details
        return details.cached_tokens if details is not None else 0

    assert cached("alice") == 0
    assert cached("bob") == 0  # the same text, another tenant
    assert cached("alice") >= 192
    assert cached("alice", "session-1") == 0  # a salt of her own splits her cache
    assert cached("alice", "session-1") >= 192
    assert cached("bob", "session-1") == 0  # the same salt text under another key is another salt
