"""Tool calling and reasoning output over HTTP, with the official openai client, streamed and not.

``tool_choice="auto"`` and the reasoning parser need a model that writes ``<think>…</think>`` and
``<tool_call>{…}</tool_call>``: the demo model cannot (its weights are random), so this module's
engine runs the scripted runner (pdserve/testing/scripted_runner.py, a stand-in for a trained model:
the real model runs, its logits are replaced by the prompt's script, the grammar still applies).
``required`` and named choices need no script: their grammar forces the calls, so the plain demo
model is used for them (its own server, without any parser)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pdserve.testing.scripted_runner import SCRIPT_MARKER, SCRIPTED_RUNNER
from tests.server.helpers import ServerThread, demo_engine_args

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["m", "km"]}},
    "required": ["answer", "unit"],
    "additionalProperties": False,
}


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.running.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    args = demo_engine_args(tmp_path_factory.mktemp("cache"), kv_cache_memory=32 << 20, max_model_len=1024)
    args.model_runner_cls = SCRIPTED_RUNNER
    args.reasoning_parser = "qwen3"
    server = ServerThread(args, tool_call_parser="hermes")
    yield _client(server)
    server.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    args = demo_engine_args(tmp_path_factory.mktemp("cache"), kv_cache_memory=32 << 20, max_model_len=1024)
    server = ServerThread(args)
    yield _client(server)
    server.close()


def _streamed(client: openai.OpenAI, **request):
    """(reasoning, content, tool calls by index as dicts, finish_reason, ids) joined from a stream."""
    reasoning, content, calls, finish, ids = "", "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            if piece.id is not None:
                assert piece.function.name and not call["name"], "id and name come once, in a call's first delta"
                call["name"] = piece.function.name
                ids.append(piece.id)
            call["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, ids


def _script(text: str) -> list[dict]:
    return [{"role": "user", "content": f"What now? {SCRIPT_MARKER} {text}"}]


def test_auto_tool_calls_are_parsed_streamed_and_not(scripted):
    script = (
        "I will look both up.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    request = dict(model="demo", messages=_script(script), tools=TOOLS, max_tokens=200, temperature=0)
    whole = scripted.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "I will look both up."
    calls = [(call.function.name, json.loads(call.function.arguments)) for call in whole.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert all(call.id.startswith("call_") and call.type == "function" for call in whole.message.tool_calls)
    reasoning, content, streamed, finish, ids = _streamed(scripted, **request)
    assert (reasoning, content, finish) == ("", "I will look both up.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert len(set(ids)) == 2


def test_auto_without_a_call_is_content(scripted):
    request = dict(model="demo", messages=_script("It is sunny."), tools=TOOLS, max_tokens=50, temperature=0)
    choice = scripted.chat.completions.create(**request).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("It is sunny.", [], "stop")


def test_reasoning_is_apart_and_the_answer_validates(scripted):
    # The thinking is text no JSON grammar allows: applied to it, the output would not be this.
    script = '<think>The answer is a distance; say it in km.</think>{"answer": 42, "unit": "km"}'
    request = dict(
        model="demo",
        messages=_script(script),
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
        max_tokens=200,
        temperature=0,
    )
    message = scripted.chat.completions.create(**request).choices[0].message
    assert message.reasoning_content == "The answer is a distance; say it in km."
    assert json.loads(message.content) == {"answer": 42, "unit": "km"}
    reasoning, content, _, finish, _ = _streamed(scripted, **request)
    assert (reasoning, content, finish) == (message.reasoning_content, message.content, "stop")


def test_the_grammar_corrects_an_answer_after_the_thinking(scripted):
    # The script's answer breaks the schema (a string for an integer): the grammar overrules it.
    script = '<think>Hmm.</think>{"answer": "many", "unit": "km"}'
    request = dict(
        model="demo",
        messages=_script(script),
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
        max_tokens=100,
        temperature=0,
    )
    choice = scripted.chat.completions.create(**request).choices[0]
    assert choice.message.reasoning_content == "Hmm."
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), ANSWER)


def test_no_thinking_when_the_answer_does_not_open_it(scripted):
    request = dict(model="demo", messages=_script('{"answer": 7, "unit": "m"}'), max_tokens=50, temperature=0)
    message = scripted.chat.completions.create(**request).choices[0].message
    assert (message.reasoning_content, message.content) == (None, '{"answer": 7, "unit": "m"}')


def test_thinking_then_a_tool_call(scripted):
    script = (
        "<think>Weather needs a city.</think>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    request = dict(model="demo", messages=_script(script), tools=TOOLS, max_tokens=100, temperature=0)
    choice = scripted.chat.completions.create(**request).choices[0]
    assert choice.message.reasoning_content == "Weather needs a city."
    assert choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_time", '{"zone": "UTC"}')
    ]
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_validate_against_their_schemas(demo, stream):
    request = dict(
        model="demo",
        messages=[{"role": "user", "content": "Weather in Paris, and the time?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=1.0,
        seed=3,
    )
    if stream:
        _, content, calls, finish, _ = _streamed(demo, **request)
    else:
        choice = demo.chat.completions.create(**request).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert finish == "tool_calls"
    assert not content
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_parallel_required_calls_each_validate(demo):
    # The random demo model rarely chooses to stop calling: every whole call is checked, up to max_tokens.
    choice = demo.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Weather in Paris, and the time?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=3,
    ).choices[0]
    calls = choice.message.tool_calls
    assert len(calls) >= 2
    whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut off
    for call in whole:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_once_and_the_round_trip_works(demo):
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    choice = demo.chat.completions.create(
        model="demo",
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
        temperature=0.7,
        seed=8,
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    # The call and its result go back in; the engine renders them and answers.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "09:00"},
    ]
    again = demo.chat.completions.create(model="demo", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert again.choices[0].message.content
    assert again.choices[0].message.tool_calls == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # this engine has no tool parser
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools[1].function.name"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_tool_requests_that_cannot_be_served_are_refused(demo, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        demo.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=extra
        )
    assert raised.value.body["param"] == param


def test_history_tool_call_arguments_must_be_json(demo):
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError) as raised:
        demo.chat.completions.create(model="demo", messages=messages, max_tokens=4)
    assert raised.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_each_of_n_choices_calls_validly(demo):
    defs_schema = {  # a local $ref: forced grammars put each schema elsewhere, and must rebase it
        "$defs": {"zone": {"type": "string", "maxLength": 6}},
        "type": "object",
        "properties": {"zone": {"$ref": "#/$defs/zone"}},
        "required": ["zone"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": defs_schema}}]
    choices = demo.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Time?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        n=2,
        max_tokens=100,
        temperature=1.0,
        seed=12,
    ).choices
    assert [c.finish_reason for c in choices] == ["tool_calls", "tool_calls"]
    arguments = [c.message.tool_calls[0].function.arguments for c in choices]
    assert arguments[0] != arguments[1]  # each choice its own seed
    for text in arguments:
        jsonschema.validate(json.loads(text), defs_schema)
