"""Structured outputs over HTTP (a real engine server, the official openai client): OpenAI's
response_format (a Pydantic model through ``chat.completions.parse``, json_object), vLLM's
structured_outputs object on both endpoints, streamed and not, and bad specs answered with a 400
naming the field while the engine keeps serving."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.testing.metrics import scrape
from pdserve.testing.schemas import SCHEMAS


class Pet(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]
    toys: list[str] = Field(max_length=2)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.running.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet,
        max_tokens=400,
        temperature=1.0,
        seed=4,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet)


def test_json_schema_streamed_equals_whole(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMAS[9], "strict": True}}
    request = dict(
        model="demo",
        messages=[{"role": "user", "content": "File a ticket."}],
        response_format=response_format,
        max_tokens=400,
        temperature=0.8,
        seed=11,
    )
    whole = client.chat.completions.create(**request)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[9])
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(stream=True, **request)
    )
    assert streamed == text


def test_structured_outputs_object_on_completions(client):
    choices = client.completions.create(
        model="demo",
        prompt="Pick one:",
        max_tokens=20,
        temperature=1.0,
        n=3,
        seed=5,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    ).choices
    assert {c.finish_reason for c in choices} == {"stop"}
    assert all(c.text in ("red", "green", "blue") for c in choices)
    regex = client.completions.create(
        model="demo",
        prompt="A code:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}},
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", regex.choices[0].text)


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"type": "object", "not": {}}}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_specs_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=5, extra_body=extra
        )
    assert error.value.status_code == 400
    assert error.value.body["param"] == param, error.value.body
    # The engine keeps serving.
    ok = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=40,
        extra_body={"structured_outputs": {"choice": ["fine"]}},
    )
    assert ok.choices[0].message.content == "fine"


def test_metrics(server, client):
    client.completions.create(
        model="demo",
        prompt="Short:",
        max_tokens=3,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMAS[1]}},
    )
    metrics = scrape(server.running.url)
    assert metrics['pdserve_structured_output_requests_total{kind="json"}'] >= 1
    assert metrics['pdserve_structured_output_requests_total{kind="choice"}'] >= 1
    assert metrics["pdserve_structured_output_length_capped_total"] >= 1  # 3 tokens cannot finish SCHEMAS[1]
    assert metrics["pdserve_grammar_compile_seconds_count"] >= 1
    assert metrics["pdserve_grammar_bitmask_seconds_count"] >= 1
    assert metrics["pdserve_num_requests_waiting_for_grammar"] == 0
    assert metrics["pdserve_grammar_compile_failures_total"] == 0
