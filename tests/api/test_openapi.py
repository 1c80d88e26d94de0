"""The OpenAPI document: the limits the server checks are stated, streams are typed per event, every error status
an operation can answer is listed, and the router's document carries its decode pods' limits. That the document
matches the live servers is what tests/fuzz/test_schemathesis_cli.py checks."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.api.openapi import LIMITS_KEY, ApiLimits, openapi_document, read_limits

LIMITS = ApiLimits(max_model_len=64, vocab_size=1024, max_n=16, max_logprobs=20, max_choices=32)


def _validator(document: dict, name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    )


@pytest.fixture(scope="module")
def engine():
    return openapi_document("engine", "v1", server="engine", limits=LIMITS)


@pytest.mark.parametrize(
    ("body", "valid"),
    [
        ({"prompt": "a"}, True),
        ({"prompt": ""}, False),
        ({"prompt": []}, False),
        ({"prompt": [1, "a"]}, False),
        ({"prompt": [0, 1023]}, True),
        ({"prompt": [1024]}, False),  # beyond the vocabulary
        ({"prompt": [1] * 63}, True),
        ({"prompt": [1] * 64}, False),  # no room for output
        ({"prompt": [[1], [2]]}, True),
        ({"prompt": [[1]] * 33}, False),  # more prompts than the engine runs at once
        ({"prompt": "a", "n": 16, "logprobs": 20, "max_tokens": 63, "min_tokens": 63}, True),
        ({"prompt": "a", "n": 17}, False),
        ({"prompt": "a", "n": 0}, False),
        ({"prompt": "a", "logprobs": 21}, False),
        ({"prompt": "a", "max_tokens": 64}, False),
        ({"prompt": "a", "max_tokens": 0}, False),
        ({"prompt": "a", "top_p": 0}, False),
        ({"prompt": "a", "top_k": -2}, False),
        ({"prompt": "a", "repetition_penalty": 0}, False),
        ({"prompt": "a", "presence_penalty": 2.5}, False),
        ({"prompt": "a", "seed": 1 << 63}, False),
        ({"prompt": "a", "stop": ""}, False),
        ({"prompt": "a", "stop": ["x", ""]}, False),
        ({"prompt": "a", "stop_token_ids": [1 << 31]}, False),
        ({"prompt": "a", "kv_transfer_params": {"anything": 1}, "n": 2}, True),  # ignored by a colocated engine
    ],
)
def test_completion_request_limits(engine, body, valid):
    assert _validator(engine, "CompletionRequest").is_valid(body) is valid


@pytest.mark.parametrize(
    ("body", "valid"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, True),
        ({"messages": []}, False),
        ({"messages": [{"role": "user"}], "top_logprobs": 20, "max_completion_tokens": 63}, True),
        ({"messages": [{"role": "user"}], "top_logprobs": 21}, False),
        ({"messages": [{"role": "user"}], "min_tokens": (1 << 31) - 1}, True),  # no default max_tokens in chat
        ({"messages": [{"role": "user"}], "chat_template_kwargs": {"enable_thinking": True, "tools": [{}]}}, True),
        ({"messages": [{"role": "user"}], "chat_template_kwargs": {"tokenize": True}}, False),
        ({"messages": [{"role": "user"}], "chat_template_kwargs": {"tools": {}}}, False),
    ],
)
def test_chat_request_limits(engine, body, valid):
    assert _validator(engine, "ChatCompletionRequest").is_valid(body) is valid


def test_an_fcfs_engine_states_that_it_takes_priority_zero_only(engine):
    fcfs = openapi_document("engine", "v1", server="engine", limits=LIMITS, priorities=False)
    for document, takes_any in ((engine, True), (fcfs, False)):
        validator = _validator(document, "CompletionRequest")
        assert validator.is_valid({"prompt": "a", "priority": 0})
        assert validator.is_valid({"prompt": "a", "priority": None})
        assert validator.is_valid({"prompt": "a", "priority": -5}) is takes_any
        assert not validator.is_valid({"prompt": "a", "priority": 1 << 63})


def test_pd_engines_state_the_p_d_protocol():
    document = openapi_document("engine", "v1", server="engine", limits=LIMITS, kv_transfer=True)
    validator = _validator(document, "CompletionRequest")
    decode_leg = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 5600,
        "remote_block_ids": [1],
        "remote_block_generations": [0],
        "remote_num_tokens": 20,
        "remote_prompt_hash": "p",
        "kv_compat_hash": "c",
        "remote_lease_seconds": 30,
    }
    assert validator.is_valid({"prompt": "a", "kv_transfer_params": decode_leg})
    assert not validator.is_valid({"prompt": "a", "kv_transfer_params": {**decode_leg, "remote_port": 0}})
    assert not validator.is_valid({"prompt": "a", "kv_transfer_params": {"do_remote_prefill": True}})
    assert validator.is_valid({"prompt": "a", "kv_transfer_params": {"do_remote_decode": True}})
    # One sequence's blocks; a prefill leg answers in one body.
    assert not validator.is_valid({"prompt": "a", "n": 2, "kv_transfer_params": {"x": 1}})
    assert validator.is_valid({"prompt": "a", "n": 2, "kv_transfer_params": {}})
    assert not validator.is_valid({"prompt": "a", "stream": True, "kv_transfer_params": {"do_remote_decode": True}})


def test_streams_are_typed_per_event(engine):
    for path, chunk in (("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionChunk")):
        event = engine["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        validator = jsonschema.Draft202012Validator({**event, "components": engine["components"]})
        assert validator.is_valid({"data": "[DONE]", "event": "message"})
        assert not validator.is_valid({"event": "message"})
        payload = event["properties"]["data"]["anyOf"][1]
        assert payload["contentMediaType"] == "application/json"
        refs = {branch["$ref"].rsplit("/", 1)[1] for branch in payload["contentSchema"]["anyOf"]}
        assert refs == {chunk, "ErrorResponse"}


def test_error_statuses_per_operation(engine):
    router = openapi_document("router", "v1", server="router", limits=LIMITS)
    generation = {"400", "401", "404", "413", "500", "503", "504"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(engine["paths"][path]["post"]["responses"]) == {"200", *generation}
        responses = router["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", *generation, "403", "429"}  # the router's tenants and flow control
        assert responses["200"]["headers"]["X-Request-Id"]["required"] is True
        assert "Retry-After" in responses["503"]["headers"] and "Retry-After" in responses["429"]["headers"]
    assert set(engine["paths"]["/health"]["get"]["responses"]) == {"200", "500", "503"}
    assert set(router["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401", "500", "503"}
    # Each server documents its own debug endpoint.
    assert "/debug/cached_blocks" in engine["paths"] and "/debug/index" not in engine["paths"]
    assert "/debug/index" in router["paths"] and "/debug/cached_blocks" not in router["paths"]
    error = engine["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}


def test_api_key_is_a_security_scheme_only_when_set(engine):
    assert "securitySchemes" not in engine["components"]
    assert all("security" not in operation for item in engine["paths"].values() for operation in item.values())
    secured = openapi_document("engine", "v1", server="engine", limits=LIMITS, api_key=True)
    assert secured["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    protected = {path for path, item in secured["paths"].items() if "security" in next(iter(item.values()))}
    assert protected == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/debug/cached_blocks"}


def test_limits_travel_in_the_document(engine):
    # The router reads its decode pods' limits back from their documents.
    assert read_limits(json.loads(json.dumps(engine))) == LIMITS
    unknown = openapi_document("router", "v1", server="router")
    assert LIMITS_KEY not in unknown and read_limits(unknown) is None
    assert read_limits([]) is None
    # Without limits, the fields they bound are still stated with what the server always checks.
    validator = _validator(unknown, "CompletionRequest")
    assert validator.is_valid({"prompt": [5000], "max_tokens": 100000})
    assert not validator.is_valid({"prompt": "a", "max_tokens": 0})
