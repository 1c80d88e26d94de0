"""An engine continuing a stream another engine broke off (``kv_transfer_params.continue``), over HTTP on a real
engine server: the stream it answers, joined to the events the client had up to the break (the token comments
say which tokens those were), is the uninterrupted stream's: the same text, the same tool calls (index, id and
arguments), the same JSON, one usage over the whole output, under the same id; nothing of the history is sent
again. A history that cannot be continued is the client's error, never a broken stream."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import jsonschema
import pytest

from pdserve.api.continuation import CONTINUED_HEADER, TOKENS_HEADER, read_tokens_comment
from pdserve.testing.scripted_runner import SCRIPT_MARKER, SCRIPTED_RUNNER
from tests.server.helpers import ServerThread, demo_engine_args

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = demo_engine_args(tmp_path_factory.mktemp("cache"), kv_cache_memory=32 << 20, max_model_len=1024)
    thread = ServerThread(args, tool_call_parser="hermes")
    yield thread
    thread.close()


class _Event:
    def __init__(self, tokens, data: dict) -> None:
        self.tokens = tokens  # the StreamTokens before it (None: an event without tokens, e.g. a role chunk)
        self.data = data


def _stream(server: ServerThread, path: str, body: dict) -> tuple[list[_Event], dict]:
    """The data events of a streamed answer and its headers."""
    request = urllib.request.Request(
        server.running.url + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", TOKENS_HEADER: "1"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        raw, headers = response.read(), dict(response.headers)
    events, pending = [], None
    for event in raw.split(b"\n\n"):
        tokens = read_tokens_comment(event)
        if tokens is not None:
            pending = tokens
        elif event.startswith(b"data: {"):
            events.append(_Event(pending, json.loads(event[6:])))
            pending = None
    return events, headers


def _continuation(events: list[_Event], cut: int) -> dict:
    """The ``continue`` params of a stream broken after its first ``cut`` events, as the router builds them."""
    choices: dict[int, dict] = {}
    for event in events[:cut]:
        if event.tokens is not None:
            choice = choices.setdefault(event.tokens.index, {"index": event.tokens.index, "token_ids": []})
            choice["token_ids"] += event.tokens.token_ids
            if event.tokens.seed is not None:
                choice["seed"] = event.tokens.seed
            if event.tokens.finish_reason is not None:
                choice["finish_reason"] = event.tokens.finish_reason
    first = events[0].data
    return {"continue": {"id": first["id"], "created": first["created"], "choices": list(choices.values())}}


def _spliced(server: ServerThread, path: str, body: dict, cut: int) -> tuple[list[_Event], list[_Event]]:
    """(uninterrupted, spliced) events: the stream, and its first ``cut`` events followed by a continuation's."""
    whole, _ = _stream(server, path, body)
    rest, headers = _stream(server, path, {**body, "kv_transfer_params": _continuation(whole, cut)})
    assert headers.get(CONTINUED_HEADER) == "1"
    return whole, whole[:cut] + rest


def _texts(events: list[_Event], field: str = "text") -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        for choice in event.data["choices"]:
            piece = choice[field] if field == "text" else (choice["delta"].get(field) or "")
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def _cuts(events: list[_Event], seed: int, count: int = 3) -> list[int]:
    """Random break points: after some event that carried tokens, before the last."""
    points = [i + 1 for i, event in enumerate(events[:-1]) if event.tokens is not None]
    return random.Random(seed).sample(points, min(count, len(points)))


def _usage_and_ids(whole: list[_Event], spliced: list[_Event]) -> None:
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached tokens depend on the cache's state
    assert [spliced[-1].data["usage"][n] for n in counts] == [whole[-1].data["usage"][n] for n in counts]
    assert {e.data["id"] for e in spliced} == {whole[0].data["id"]}
    assert {e.data["created"] for e in spliced} == {whole[0].data["created"]}


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_p": 0.9, "seed": 5},
        {"temperature": 1.0, "top_k": 20, "seed": 6, "frequency_penalty": 0.5, "presence_penalty": 0.3},
        {"temperature": 0.6, "min_p": 0.1, "seed": 8, "repetition_penalty": 1.3},
        {"temperature": 1.3, "top_p": 0.8, "top_k": 50, "seed": -(2**40)},
    ],
    ids=["greedy", "seeded", "penalties", "repetition", "negative-seed"],
)
def test_a_continued_completion_is_the_uninterrupted_one(server, sampling):
    body = {
        "model": "demo",
        "prompt": "A long way from home, the traveller",
        "max_tokens": 30,
        "min_tokens": 25,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 2,
        **sampling,
    }
    whole, _ = _stream(server, "/v1/completions", body)
    for cut in _cuts(whole, 1):
        reference, spliced = _spliced(server, "/v1/completions", body, cut)
        assert _texts(spliced) == _texts(reference)
        tokens = [t for e in spliced if e.tokens for t in e.tokens.token_ids]
        assert tokens == [t for e in reference if e.tokens for t in e.tokens.token_ids]
        # Each token's logprobs once, the continued part's from the new engine.
        logprobs = [t for e in spliced for c in e.data["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert len(logprobs) == 30
        _usage_and_ids(reference, spliced)


def test_stop_strings_see_the_text_across_the_splice(server):
    body = {"model": "demo", "prompt": "Count: one two three", "max_tokens": 40, "temperature": 0.0, "stream": True}
    whole, _ = _stream(server, "/v1/completions", body)
    text = _texts(whole)[0]
    stop = text[12:16]  # a stop string from the middle of the answer: the cut may fall inside it
    body = {**body, "stop": [stop]}
    whole, _ = _stream(server, "/v1/completions", body)
    for cut in _cuts(whole, 2, count=len(whole)):
        reference, spliced = _spliced(server, "/v1/completions", body, cut)
        assert _texts(spliced) == _texts(reference) == {0: text[: text.index(stop)]}


def test_n_choices_continue_each_from_its_own_tokens(server):
    body = {
        "model": "demo",
        "prompt": "Two roads",
        "n": 3,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    whole, _ = _stream(server, "/v1/completions", body)
    for cut in _cuts(whole, 3):
        reference, spliced = _spliced(server, "/v1/completions", body, cut)
        assert _texts(spliced) == _texts(reference)
        assert len(_texts(spliced)) == 3
        _usage_and_ids(reference, spliced)


def test_a_tool_call_split_by_the_break_keeps_its_index_id_and_arguments(server):
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 250,
        "temperature": 0.7,
        "seed": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    whole, _ = _stream(server, "/v1/chat/completions", body)
    assert not whole[0].data["choices"][0]["delta"].get("tool_calls")  # the role chunk
    for cut in _cuts(whole, 4):
        reference, spliced = _spliced(server, "/v1/chat/completions", body, max(cut, 1))
        assert sum(1 for e in spliced if e.data["choices"] and e.data["choices"][0]["delta"].get("role")) == 1
        calls = [call for e in spliced for c in e.data["choices"] for call in (c["delta"].get("tool_calls") or [])]
        expected = [call for e in reference for c in e.data["choices"] for call in (c["delta"].get("tool_calls") or [])]
        assert calls == expected
        indexes = sorted({call["index"] for call in calls})
        assert indexes == list(range(len(indexes))) and len([c for c in calls if c.get("id")]) == len(indexes)
        for index in indexes:  # each call's fragments join into its arguments
            arguments = "".join(c["function"].get("arguments") or "" for c in calls if c["index"] == index)
            jsonschema.validate(json.loads(arguments), WEATHER)
        finishes = [c["finish_reason"] for e in spliced for c in e.data["choices"] if c["finish_reason"]]
        assert finishes == ["tool_calls"]
        _usage_and_ids(reference, spliced)


def test_structured_output_continued_mid_json_still_validates(server):
    body = {
        "model": "demo",
        "prompt": "A record:",
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 21,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}},
    }
    whole, _ = _stream(server, "/v1/completions", body)
    for cut in _cuts(whole, 5):
        reference, spliced = _spliced(server, "/v1/completions", body, cut)
        text = _texts(spliced)[0]
        assert text == _texts(reference)[0]
        jsonschema.validate(json.loads(text), RECORD)


def _refused(server: ServerThread, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.running.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    # Refused once the stream started: its error event.
    event = next(e for e in raw.split(b"\n\n") if e.startswith(b"data: {"))
    answer = json.loads(event[6:])
    return answer["error"]["code"], answer


@pytest.mark.parametrize(
    "extra, continued, words",
    [
        ({}, {"choices": [{"index": 0, "token_ids": [1] * 8}]}, "nothing is left"),  # as long as max_tokens
        ({"stream": False}, {"choices": []}, "stream=true"),
        ({}, {"choices": [{"index": 3, "token_ids": []}]}, "does not have"),
        ({}, {"choices": [{"index": 0, "token_ids": [-1]}]}, "token ids"),
        ({"response_format": {"type": "json_object"}}, {"choices": [{"index": 0, "token_ids": [67, 67]}]}, "grammar"),
    ],
    ids=["nothing-left", "not-a-stream", "unknown-choice", "bad-token", "grammar-rejects"],
)
def test_a_history_that_cannot_be_continued_is_a_client_error(server, extra, continued, words):
    body = {"model": "demo", "prompt": "x", "max_tokens": 8, "stream": True, **extra}
    body["kv_transfer_params"] = {"continue": {"id": "cmpl-1", "created": 1, **continued}}
    code, answer = _refused(server, body)
    assert code == 400 and words in answer["error"]["message"], answer


def test_an_unseeded_stream_gets_a_seed_that_a_continuation_draws_from(server):
    body = {"model": "demo", "prompt": "Anything at all", "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    body |= {"stream": True}
    whole, _ = _stream(server, "/v1/completions", body)
    seed = whole[0].tokens.seed
    assert seed is not None and all(e.tokens.seed is None for e in whole[1:])
    seeded, _ = _stream(server, "/v1/completions", {**body, "seed": seed})
    assert _texts(seeded) == _texts(whole)  # the seed it was given is the seed it drew from
    for cut in _cuts(whole, 6):
        rest, _ = _stream(server, "/v1/completions", {**body, "kv_transfer_params": _continuation(whole, cut)})
        assert _texts(whole[:cut] + rest) == _texts(whole)
    # Without the router's header nothing changes: no seed is picked (nor said).
    request = urllib.request.Request(
        server.running.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert b"pdserve-tokens" not in response.read()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A model that writes what its prompt's script says (pdserve/testing/scripted_runner.py): thinking, content
    and tool calls in the formats the qwen3 reasoning parser and the hermes tool parser read."""
    args = demo_engine_args(tmp_path_factory.mktemp("scripted"), kv_cache_memory=32 << 20, max_model_len=1024)
    args.model_runner_cls = SCRIPTED_RUNNER
    args.reasoning_parser = "qwen3"
    thread = ServerThread(args, tool_call_parser="hermes")
    yield thread
    thread.close()


def test_the_parsers_read_one_continuous_text_across_the_splice(scripted):
    script = (
        "<think>Two cities, one call each.</think>I will look both up.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    )
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": f"What now? {SCRIPT_MARKER} {script}"}],
        "tools": TOOLS,
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    whole, _ = _stream(scripted, "/v1/chat/completions", body)
    reference = whole
    for cut in range(1, len(whole) - 1, len(whole) // 7):  # in the thinking, the content, and inside each call
        rest, _ = _stream(scripted, "/v1/chat/completions", {**body, "kv_transfer_params": _continuation(whole, cut)})
        spliced = whole[:cut] + rest
        for field in ("reasoning_content", "content"):
            assert _texts(spliced, field) == _texts(reference, field)
        calls = [c for e in spliced for ch in e.data["choices"] for c in ch["delta"].get("tool_calls") or []]
        expected = [c for e in reference for ch in e.data["choices"] for c in ch["delta"].get("tool_calls") or []]
        assert "".join(json.dumps(c) for c in calls) == "".join(json.dumps(c) for c in expected)
        assert [c["finish_reason"] for e in spliced for c in e.data["choices"] if c["finish_reason"]] == ["tool_calls"]
    assert _texts(whole, "reasoning_content") == {0: "Two cities, one call each."}
