"""Schemathesis fuzzing of a live pdserve HTTP server (an engine or the router), driven by the server's own
/openapi.json: the checks every answer must pass, the runner for one operation and the assertions every server's
runs share, and the request bodies the fuzz tests send by hand (test_findings.py pins what the fuzzing found;
none is open now). test_schemathesis_cli.py runs schemathesis's own CLI, with all its checks, instead.
"""

from __future__ import annotations

import copy
import json
import os
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

import jsonschema
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from pdserve.api.openapi import read_limits

MODEL = "demo"  # the served model name of every fuzzed server

POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# What each server gets: (path, method, document, mode, examples). "plain" is the served document; "within_limits"
# and "streaming" are the ones load_schema_within_limits narrows. GET operations take no input: no negative cases.
RUNS = [
    (path, "POST", document, mode, examples)
    for path in ("/v1/completions", "/v1/chat/completions")
    for document, mode, examples in (
        ("plain", POSITIVE, 60),
        ("plain", NEGATIVE, 50),
        ("within_limits", POSITIVE, 40),
        ("streaming", POSITIVE, 25),
    )
]
RUNS += [("/v1/models", "GET", "plain", POSITIVE, 3), ("/health", "GET", "plain", POSITIVE, 3)]
RUN_IDS = [f"{method} {path} {document} {mode.value}" for path, method, document, mode, _ in RUNS]
# Schemathesis reads 20 events of a stream by default; a whole stream is needed to check how it ends. The largest
# the engines accept (16 choices of up to 63 tokens, plus role and usage events) stays well below this.
MAX_STREAM_EVENTS = 5000


def load_schema(url: str) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=30)
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    return schema


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _number(low: float, high: float) -> dict[str, Any]:
    return {"type": "number", "minimum": low, "maximum": high}


def load_schemas(url: str) -> dict[str, schemathesis.BaseSchema]:
    """The documents RUNS use, by name."""
    return {
        "plain": load_schema(url),
        "within_limits": load_schema_within_limits(url),
        "streaming": load_schema_within_limits(url, streaming=True),
    }


def load_schema_within_limits(url: str, streaming: bool = False) -> schemathesis.BaseSchema:
    """The server's document with request fields narrowed well inside what a 64-token demo engine accepts, clear
    of the limits across fields the document cannot state (docs/openapi.md), and small enough to be cheap.
    Schema-valid requests are then served, so streams, logprobs, echo, several choices and stop conditions are
    exercised, not only 400s. Response schemas are untouched: answers are still checked against the real
    document. With ``streaming``, every request asks for a stream (otherwise few would: stream is one optional
    field of many)."""
    document = copy.deepcopy(load_schema(url).raw_schema)
    schemas = document["components"]["schemas"]
    token = _integer(0, read_limits(document).vocab_size - 1)
    # Random unicode reaches 4 bytes a character, and the demo tokenizer is byte-level: 8 characters stay
    # within a 64-token context even after a chat template.
    text = {"type": "string", "minLength": 1, "maxLength": 8}
    shared = {
        "model": _nullable({"const": MODEL}),
        "n": _nullable(_integer(1, 3)),
        "temperature": _nullable(_number(0, 2)),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0.01, "maximum": 1}),
        "top_k": _nullable(_integer(-1, 50)),
        "min_p": _nullable(_number(0, 1)),
        "presence_penalty": _nullable(_number(-2, 2)),
        "frequency_penalty": _nullable(_number(-2, 2)),
        "repetition_penalty": _nullable(_number(0.5, 2)),
        "seed": _nullable(_integer(0, 1 << 32)),
        "stop": _nullable({"anyOf": [text, {"type": "array", "maxItems": 2, "items": text}]}),
        "stop_token_ids": _nullable({"type": "array", "maxItems": 3, "items": token}),
        "min_tokens": _nullable(_integer(0, 2)),
        "max_tokens": _nullable(_integer(1, 8)),
        "max_completion_tokens": _nullable(_integer(1, 8)),
        "top_logprobs": _nullable(_integer(0, 5)),
        "cache_salt": _nullable(text),
        # P/D parameters (which colocated engines and the router ignore) and template arguments are fuzzed in the
        # plain runs.
        "kv_transfer_params": {"type": "null"},
        "chat_template_kwargs": {"type": "null"},
        # The tools section of the demo template alone is longer than the context: tools are fuzzed in the plain runs.
        "tools": {"type": "null"},
        "tool_choice": {"type": "null"},
    }
    if streaming:
        shared["stream"] = {"const": True}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = schemas[name]["properties"]
        properties.update({key: value for key, value in shared.items() if key in properties})
        if streaming:
            schemas[name]["required"].append("stream")
    completion = schemas["CompletionRequest"]["properties"]
    completion["logprobs"] = _nullable(_integer(0, 5))
    token_list = {"type": "array", "minItems": 1, "maxItems": 24, "items": token}
    completion["prompt"] = {
        "anyOf": [
            text,
            {"type": "array", "minItems": 1, "maxItems": 3, "items": text},
            token_list,
            {"type": "array", "minItems": 1, "maxItems": 3, "items": token_list},
        ]
    }
    schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 2
    message = schemas["ChatMessage"]["properties"]
    message["role"] = {"enum": ["system", "user", "assistant"]}
    message["tool_calls"] = {"type": "null"}
    message["content"] = _nullable(
        {"anyOf": [text, {"type": "array", "maxItems": 2, "items": {"$ref": "#/components/schemas/TextContentPart"}}]}
    )
    schemas["TextContentPart"]["properties"]["text"] = text
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=url)
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    return schema


def get_json(url: str, timeout: float = 10) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, None


# ----- checks (schemathesis calls each with (ctx, response, case); a failed assert is a failure) ------------


def no_server_error(ctx, response, case) -> None:
    # 503 + Retry-After is the documented overload/drain answer, not a crash; the runner counts those
    # separately, because in these quiet runs there should be none either.
    if response.status_code == 503 and "retry-after" in response.headers:
        return
    assert response.status_code < 500, f"server error {response.status_code}: {response.content[:500]!r}"


def _check_error_object(payload: Any, status: int | None) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, f"not an OpenAI error object: {payload!r}"
    error = payload["error"]
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys(), f"error fields: {error!r}"
    assert isinstance(error["message"], str) and error["message"], f"empty error message: {error!r}"
    assert isinstance(error["type"], str) and error["type"], f"empty error type: {error!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"param: {error!r}"
    if status is not None:
        assert error["code"] == status, f"code {error['code']!r} != HTTP status {status}"


def openai_error_shape(ctx, response, case) -> None:
    """Every 4xx/5xx body is {"error": {"message", "type", "param", "code"}}, code = the HTTP status: stricter
    than the document's ErrorResponse (which does not require param and code), and applied to every status,
    documented or not."""
    if response.status_code < 400:
        return
    try:
        payload = json.loads(response.content)
    except ValueError as error:
        raise AssertionError(f"error body is not JSON: {response.content[:300]!r}") from error
    _check_error_object(payload, response.status_code)


class SseEventsConform:
    """A whole stream: read to its end, `[DONE]` last and only there, each other event a JSON chunk of the
    operation's chunk schema or an error object (the way a failure after the headers travels). Schemathesis's
    response_schema_conformance checks each event against the document's event schema, but not the order."""

    __name__ = "sse_events_conform"

    def __init__(self, document: dict[str, Any]) -> None:
        def validator(name: str) -> jsonschema.Draft202012Validator:
            root = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
            return jsonschema.Draft202012Validator(root)

        self.chunks = {
            "/v1/completions": validator("CompletionResponse"),
            "/v1/chat/completions": validator("ChatCompletionChunk"),
        }
        self.error = validator("ErrorResponse")

    def __call__(self, ctx, response, case) -> None:
        content_type = (response.headers.get("content-type") or [""])[0]
        if not content_type.startswith("text/event-stream"):
            return
        assert not response.stream_cut_short, "the stream was not read to its end"
        events = [event for event in response.content.decode().split("\n\n") if event.strip()]
        assert events and events[-1] == "data: [DONE]", f"stream does not end with [DONE]: {events[-3:]!r}"
        for event in events[:-1]:
            assert event.startswith("data: "), f"not a data event: {event[:200]!r}"
            payload = json.loads(event[len("data: ") :])
            if "error" in payload:
                _check_error_object(payload, None)
                self.error.validate(payload)
            else:
                self.chunks[case.operation.path].validate(payload)


# ----- the runner -------------------------------------------------------------------------------------------


def _whole_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _whole_floats_as_ints(item) for key, item in value.items()}
    return value


def _send_integers_as_integers(case):
    # Schemathesis sends some integers as whole floats (3.0: an integer by JSON Schema since draft 6), which the
    # engines refuse (msgspec is strict: "Expected `int`, got `float`"), a mismatch the plain runs already meet.
    # The within-limits runs exist to reach the serving paths, so they send plain integers.
    case.body = _whole_floats_as_ints(case.body)
    return case


def fuzz(
    schema: schemathesis.BaseSchema,
    path: str,
    method: str,
    mode: GenerationMode,
    max_examples: int,
    whole_floats_as_ints: bool = False,
) -> Counter:
    """Send ``max_examples`` generated requests to one operation, each checked; returns the status counts (plus
    "streams": event-stream answers, "overloaded": 503 + Retry-After answers). Deterministic unless the
    environment's PDSERVE_FUZZ_SEED picks another run."""
    operation = schema[path][method.upper()]
    checks = [
        no_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        negative_data_rejection,
        openai_error_shape,
        SseEventsConform(schema.raw_schema),
    ]
    statuses: Counter = Counter()
    chosen_seed = os.environ.get("PDSERVE_FUZZ_SEED")
    strategy = operation.as_strategy(generation_mode=mode)
    if whole_floats_as_ints:
        strategy = strategy.map(_send_integers_as_integers)

    # No shrinking: a failure is reported with its curl command, and shrinking against a live server (maybe one
    # the failure just broke) could take minutes. The example database would make runs depend on history.
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=chosen_seed is None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    @given(case=strategy)
    def run(case) -> None:
        response = case.call_and_validate(checks=checks, timeout=60)
        statuses[response.status_code] += 1
        if (response.headers.get("content-type") or [""])[0].startswith("text/event-stream"):
            statuses["streams"] += 1
        if response.status_code == 503:
            statuses["overloaded"] += 1

    if chosen_seed is not None:
        run = seed(int(chosen_seed))(run)
    run()
    return statuses


def run_operation(
    schemas: dict[str, schemathesis.BaseSchema],
    path: str,
    method: str,
    document: str,
    mode: GenerationMode,
    examples: int,
    server: str,
) -> Counter:
    """One of RUNS against ``server`` (its name, for messages), with what every server's runs must show."""
    statuses = fuzz(schemas[document], path, method, mode, examples, whole_floats_as_ints=document != "plain")
    print(f"{method} {path} {document} {mode.value}: {dict(statuses)}")  # shown with -s: what the run exercised
    assert statuses["overloaded"] == 0, f"503 overload answers from an idle {server}: {statuses}"
    if document != "plain":
        # The narrowed document describes requests the server serves; mostly refusing them means it drifted.
        assert statuses[200] >= examples // 2, statuses
        assert document != "streaming" or statuses["streams"] == statuses[200], statuses
    elif method == "POST" and mode is POSITIVE:
        assert statuses[200] > 0, statuses
    return statuses


# ----- request bodies sent by hand --------------------------------------------------------------------------


def completion_body(prompt: Any = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **fields}


def chat_body(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def prefill_leg_body(prompt: Any, **fields: Any) -> dict[str, Any]:
    """What the router sends a prefill engine: one token, the blocks held for a decode engine to pull."""
    return completion_body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **fields)
