"""The hermes tool parser, the reasoning streams and tool_choice checks, without a server: a stream
cut anywhere reads the same as the whole text; forced-call grammars accept exactly the calls they
should."""

from __future__ import annotations

import itertools
import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from pdserve.api.protocol import ChatCompletionRequest, decode_request
from pdserve.engine.reasoning import REASONING_PARSERS, ReasoningMarkers, ReasoningStart
from pdserve.server.chat_output import ChatOutputReader
from pdserve.server.input_processor import InputError
from pdserve.server.reasoning import ReasoningStream
from pdserve.server.tool_parsers import HermesToolParser, call_ids, collect_calls
from pdserve.server.tools import tool_use

HERMES = HermesToolParser()
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "list": [1, {"a": "}"}]}}\n</tool_call>'


def _read_in_pieces(text: str, cuts: list[int], reasoning: ReasoningStream | None = None):
    reader = ChatOutputReader(reasoning, HERMES.stream(call_ids("chatcmpl-test", 0)))
    pieces = []
    bounds = [0, *cuts, len(text)]
    for start, end in itertools.pairwise(bounds):
        pieces.append(reader.feed(text[start:end]))
    pieces.append(reader.finish())
    calls = collect_calls(call for piece in pieces for call in piece.calls)
    return (
        "".join(p.reasoning for p in pieces),
        "".join(p.content for p in pieces),
        [(c.function.name, c.function.arguments) for c in calls],
    )


TEXTS = [
    "Plain text, no calls.",
    "  leading and trailing  ",
    f"Let me check.\n{CALL}",
    f"{CALL}\n{CALL}",
    f"{CALL} and after",
    '<tool_call>\n{"name": "f"}\n</tool_call>',  # no arguments: {}
    '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>',  # arguments first
    "<tool_call>not json</tool_call> text",  # not a call: stays content
    '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2',  # cut off by max_tokens
    "a < b <tool_call is not a tag",
]


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_cut_anywhere_reads_as_the_whole(text):
    whole = _read_in_pieces(text, [])
    for cut in range(1, len(text)):
        assert _read_in_pieces(text, [cut]) == whole, cut
    assert _read_in_pieces(text, list(range(1, len(text)))) == whole  # one character at a time


def test_what_the_hermes_parser_reads():
    assert _read_in_pieces(f"Let me check.\n{CALL}", []) == (
        "",
        "Let me check.",
        [("get_time", '{"zone": "CET", "list": [1, {"a": "}"}]}')],
    )
    assert _read_in_pieces(TEXTS[5], [])[2] == [("f", "{}")]
    assert _read_in_pieces(TEXTS[6], [])[2] == [("f", '{"x": 1}')]
    assert _read_in_pieces(TEXTS[7], []) == ("", "<tool_call>not json</tool_call> text", [])
    assert _read_in_pieces(TEXTS[8], [])[2] == [("f", '{"x": [1, 2')]
    assert _read_in_pieces(f"{CALL} and after", [])[1] == "and after"
    assert _read_in_pieces("  leading and trailing  ", [])[1] == "  leading and trailing  "


def test_the_reasoning_parsers_split_thinking_from_the_answer():
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    text = f"<think>Plan: call.</think>\n\n{CALL}"
    cases = [
        (qwen3, ReasoningStart.OPTIONAL, text, ("Plan: call.", "", [("get_time",)])),
        (qwen3, ReasoningStart.OPTIONAL, "No <think> here", ("", "No <think> here", [])),
        (qwen3, ReasoningStart.ANSWER, "<think>x</think>y", ("", "<think>x</think>y", [])),
        (r1, ReasoningStart.THINKING, "thought</think>answer", ("thought", "answer", [])),
        (r1, ReasoningStart.THINKING, "<think>thought</think>answer", ("thought", "answer", [])),
        (r1, ReasoningStart.THINKING, "thinking, cut off", ("thinking, cut off", "", [])),
    ]
    for parser, start, text, (reasoning, content, names) in cases:
        whole = _read_in_pieces(text, [], ReasoningStream(parser, start))
        assert whole[:2] == (reasoning, content)
        assert [call[:1] for call in whole[2]] == names
        for cut in range(1, len(text)):
            assert _read_in_pieces(text, [cut], ReasoningStream(parser, start)) == whole


def test_where_the_output_starts_is_read_from_the_prompts_end(demo_tokenizer):
    markers = ReasoningMarkers.of(REASONING_PARSERS["qwen3"], demo_tokenizer)

    def start(text: str, parser: str = "qwen3") -> ReasoningStart:
        ids = demo_tokenizer.encode(text)
        of = ReasoningMarkers(REASONING_PARSERS[parser], markers.start_id, markers.end_id)
        return of.start_of(ids, lambda token: demo_tokenizer.decode([token]).isspace())

    assert start("<|im_start|>assistant\n") is ReasoningStart.OPTIONAL
    assert start("<|im_start|>assistant\n", "deepseek_r1") is ReasoningStart.THINKING
    assert start("<|im_start|>assistant\n<think>\n\n</think>\n\n") is ReasoningStart.ANSWER
    assert start("<|im_start|>assistant\n<think>\n") is ReasoningStart.THINKING
    assert start("<think>old</think> then a new turn<|im_start|>assistant\n") is ReasoningStart.OPTIONAL


@pytest.fixture(scope="module")
def demo_tokenizer():
    from pdserve.api.tokenizer import load_tokenizer
    from pdserve.models.demo import ensure_demo_model

    return load_tokenizer(ensure_demo_model())


def test_forced_grammars_accept_calls_of_the_tools_only():
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    one = HERMES.forced_grammar([("get_weather", weather)], parallel=False)
    many = HERMES.forced_grammar([("get_weather", weather), ("root", {"type": "object"})], parallel=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "root", "arguments": {}}\n</tool_call>'
    accepts = [
        (one, call, True),
        (one, f"{call}\n{call}", False),
        (one, call.replace("Oslo", "Os\nlo"), False),  # a raw control character is not JSON
        (one, call.replace('"city"', '"town"'), False),
        (one, other, False),
        (many, f"{call}\n{other}", True),
        (many, "", False),
    ]
    for grammar, text, expected in accepts:
        assert _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar), text) is expected, text


def _request(**fields) -> ChatCompletionRequest:
    return decode_request(
        json.dumps({"messages": [{"role": "user", "content": "x"}], **fields}).encode(), ChatCompletionRequest
    )


def test_tool_choice_defaults_and_forcing():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tool_use(_request(tools=tools), None).parser is None  # "none" without a parser
    assert tool_use(_request(tools=tools), HERMES).parser is HERMES  # "auto" with one
    forced = tool_use(_request(tools=tools, tool_choice="required"), None)
    assert forced.parser is not None and forced.constraint is not None and forced.constraint.grammar
    assert tool_use(_request(tools=tools, tool_choice="none"), HERMES).parser is None
    with pytest.raises(InputError) as raised:
        tool_use(_request(tools=[{"type": "function", "function": {"name": "a b"}}], tool_choice="required"), None)
    assert raised.value.param == "tools[0].function.name"
