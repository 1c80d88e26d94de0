"""Disaggregated serving through the router equals colocated serving, token for token: 1P1D over
NIXL and over TCP, 2P2D over NIXL, and 1P1D over NIXL with each engine's model (and transfer agent)
in a worker process of its own (TCP, 2P2D and workers in make test-slow), each a real cluster of processes
started once. Structured outputs too: the decode applies the grammar, the outputs equal colocated
ones with the same seeds."""

from __future__ import annotations

import json
import random
import urllib.request

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.api.report import REPORT_COMMENT
from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import scrape
from pdserve.testing.schemas import SCHEMAS
from tests.pd.cluster import Cluster, assert_a_cached_prefix_is_not_pulled_again, post

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 8


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    prefixes = [[rng.randrange(10, 1000) for _ in range(100)] for _ in range(3)]
    prompts = []
    for index in range(32):
        if index % 3 == 0:
            prompts.append([rng.randrange(10, 1000) for _ in range(rng.randrange(5, 300))])
        else:  # shares a 100-token prefix with other prompts
            prompts.append(prefixes[index % 3] + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 150))])
    assert sum(len(p) > 8 * 16 for p in prompts) >= 8
    return prompts


@pytest.fixture(scope="module")
def expected() -> list[str]:
    llm = LLM(str(ensure_demo_model()), device="cpu", max_model_len=512, num_kv_blocks=256)
    outputs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [output.outputs[0].text for output in outputs]


@pytest.fixture(
    scope="module",
    # TCP, two of each engine and the worker-process executor in make test-slow (make test's time budget):
    # make test keeps one of each over NIXL.
    params=[
        pytest.param(("nixl", 1, 1, "uni"), id="nixl-1p1d"),
        pytest.param(("tcp", 1, 1, "uni"), id="tcp-1p1d", marks=pytest.mark.slow),
        pytest.param(("nixl", 2, 2, "uni"), id="nixl-2p2d", marks=pytest.mark.slow),
        pytest.param(("nixl", 1, 1, "mp"), id="nixl-1p1d-workers", marks=pytest.mark.slow),
    ],
)
def cluster(request, tmp_path_factory):
    transport, num_prefill, num_decode, executor = request.param
    flags = ("--distributed-executor-backend", executor)
    cluster = Cluster.start(
        tmp_path_factory.mktemp(f"{transport}-{num_prefill}p{num_decode}d-{executor}"),
        transport,
        num_prefill,
        num_decode,
        prefill_flags=flags,
        decode_flags=flags,
    )
    yield cluster
    cluster.stop()


def _complete(cluster: Cluster, prompt: list[int], **extra) -> dict:
    status, answer = post(
        cluster.router.url + "/v1/completions",
        {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra},
    )
    assert status == 200, answer
    return answer


def test_disaggregated_outputs_equal_colocated(cluster, expected):
    texts = [_complete(cluster, prompt)["choices"][0]["text"] for prompt in _prompts()]
    assert texts == expected
    router = scrape(cluster.router.url)
    assert router['pdserve_router_requests_total{path="disagg"}'] == len(expected)
    assert router['pdserve_router_requests_total{path="fallback"}'] == 0
    # Every answer's report (lengths and latency, as its decode engine measured them) is counted.
    assert router["pdserve_router_requests_received_total"] == len(expected)
    assert router["pdserve_request_prompt_tokens_sum"] == sum(map(len, _prompts()))
    assert router["pdserve_request_generation_tokens_sum"] == len(expected) * MAX_TOKENS
    assert router["pdserve_router_time_to_first_token_seconds_count"] == len(expected)
    assert router["pdserve_router_time_per_output_token_seconds_count"] == len(expected)
    assert router["pdserve_router_time_to_first_token_seconds_sum"] > 0
    pulled = sum(scrape(d.url)["pdserve_kv_transfer_bytes_total"] for d in cluster.decodes)
    failures = sum(scrape(d.url)["pdserve_kv_transfer_failures_total"] for d in cluster.decodes)
    assert pulled > 0 and failures == 0
    if len(cluster.decodes) > 1:  # both decode engines took part
        assert all(scrape(d.url)["pdserve_kv_transfer_bytes_total"] > 0 for d in cluster.decodes)


def test_streamed_chat_through_the_router(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.router.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Tell me about the sea. " * 10}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        == whole.choices[0].message.content
    )
    # The stream's report reached the router's histograms, and the router kept it from the client.
    before = scrape(cluster.router.url)["pdserve_request_generation_tokens_count"]
    raw = urllib.request.urlopen(
        urllib.request.Request(
            cluster.router.url + "/v1/chat/completions",
            json.dumps({"model": "demo", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        ),
        timeout=60,
    ).read()
    assert raw.endswith(b"data: [DONE]\n\n") and REPORT_COMMENT not in raw
    assert scrape(cluster.router.url)["pdserve_request_generation_tokens_count"] == before + 1


def test_a_prefix_cached_on_decode_is_not_pulled_again(cluster):
    if len(cluster.decodes) > 1:
        pytest.skip("which decode engine serves a request is the router's choice")
    assert_a_cached_prefix_is_not_pulled_again(cluster.decodes[0].url, lambda prompt: _complete(cluster, prompt))


@pytest.fixture(scope="module")
def structured_expected() -> list[str]:
    llm = LLM(str(ensure_demo_model()), device="cpu", max_model_len=512, num_kv_blocks=256)
    outputs = llm.generate(_structured_prompts(), [_structured_params(i) for i in range(len(SCHEMAS[:4]))])
    return [output.outputs[0].text for output in outputs]


def _structured_prompts() -> list[list[int]]:
    return [prompt[: 20 + 9 * i] for i, prompt in enumerate(_prompts()[:4])]


def _structured_params(index: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=300,
        temperature=1.0,
        seed=40 + index,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS[index]),
    )


def test_structured_outputs_through_the_router_equal_colocated(cluster, structured_expected):
    # The prefill leg checks the schema but applies nothing; the decode compiles it while it pulls
    # the prompt's KV and applies it from its first token: the same seeded outputs as colocated.
    texts = []
    for index, prompt in enumerate(_structured_prompts()):
        answer = _complete(
            cluster,
            prompt,
            max_tokens=300,
            temperature=1.0,
            seed=40 + index,
            structured_outputs={"json": SCHEMAS[index]},
        )
        assert answer["choices"][0]["finish_reason"] == "stop"
        texts.append(answer["choices"][0]["text"])
        jsonschema.validate(json.loads(texts[-1]), SCHEMAS[index])
    assert texts == structured_expected
    status, answer = post(
        cluster.router.url + "/v1/completions",
        {"model": "demo", "prompt": [1, 2, 3], "max_tokens": 5, "structured_outputs": {"regex": "(["}},
    )
    assert status == 400 and answer["error"]["param"] == "structured_outputs.regex"


def test_forced_tool_calls_through_the_router(cluster):
    """The router renders the tools into the prompt as the engines do; the decode forces the call."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.router.url + "/v1", api_key="unused")
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["red", "blue"]}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "file_record", "parameters": schema}}]
    request = dict(
        model="demo",
        messages=[{"role": "user", "content": "File it."}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=6,
    )
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schema)
    arguments = "".join(
        piece.function.arguments or ""
        for chunk in client.chat.completions.create(stream=True, **request)
        for piece in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
    )
    assert arguments == call.function.arguments
