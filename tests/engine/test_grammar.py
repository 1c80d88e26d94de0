"""Grammar specs of structured outputs: normalised (one cache key per constraint), checked before a
request is accepted (bad syntax, keywords xgrammar would ignore, size), and compiled into grammars
that only allow valid JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.api.tokenizer import load_tokenizer
from pdserve.engine.grammar import MAX_SPEC_BYTES, GrammarError, GrammarSpec, check_grammar, grammar_of, grammar_spec
from pdserve.engine.reasoning import REASONING_PARSERS, ReasoningMarkers, blank_token_test
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from pdserve.engine.structured_outputs import StructuredOutputManager
from pdserve.models.demo import ensure_demo_model


def test_specs_are_normalised():
    a = grammar_spec(StructuredOutputsParams(json={"type": "object", "required": ["b"], "properties": {"b": {}}}))
    b = grammar_spec(StructuredOutputsParams(json='{"properties": {"b": {}}, "required": ["b"], "type": "object"}'))
    assert a == b and a.kind == "json" and not a.any_whitespace
    loose = grammar_spec(StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False))
    assert loose.any_whitespace
    choice = grammar_spec(StructuredOutputsParams(choice=['say "hi"', "bye"]))
    assert choice == GrammarSpec("grammar", 'root ::= "say \\"hi\\"" | "bye"')
    assert grammar_spec(StructuredOutputsParams(json_object=True)).kind == "json_object"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"regex": 5}, "structured_outputs.regex"),
        ({"json_object": False}, "structured_outputs"),
    ],
)
def test_exactly_one_well_typed_constraint(fields, param):
    with pytest.raises(SamplingParamsError) as error:
        StructuredOutputsParams(**fields)
    assert error.value.param == param


@pytest.mark.parametrize(
    "params, param, words",
    [
        (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex", "parenthesis"),
        (StructuredOutputsParams(grammar="root ::= foo"), "structured_outputs.grammar", "foo"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json", "not valid JSON"),
        (StructuredOutputsParams(json={"type": "frog"}), "structured_outputs.json", "frog"),
        (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "structured_outputs.json", "missing"),
        (
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
            "structured_outputs.json",
            "not",
        ),
        (
            StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
            "structured_outputs.json",
            "uniqueItems",
        ),
        (
            StructuredOutputsParams(json={"type": "string", "pattern": "^a+$", "maxLength": 4}),
            "structured_outputs.json",
            "pattern",
        ),
        (StructuredOutputsParams(regex="a" * (MAX_SPEC_BYTES + 1)), "structured_outputs.regex", "bytes"),
    ],
)
def test_what_cannot_be_enforced_is_refused_naming_the_field(params, param, words):
    with pytest.raises(GrammarError) as error:
        check_grammar(grammar_spec(params))
    assert error.value.param == param
    assert words in str(error.value)


def test_a_property_named_like_a_keyword_is_fine():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}}
    check_grammar(grammar_spec(StructuredOutputsParams(json=schema)))


def test_json_strings_never_allow_raw_control_characters():
    # xgrammar's rule for length-bounded strings lets raw control characters through; ours does not.
    for schema in ({"type": "string", "maxLength": 5}, {"type": "object", "properties": {"a": {"type": "string"}}}):
        text = str(grammar_of(grammar_spec(StructuredOutputsParams(json=json.dumps(schema)))))
        for line in text.splitlines():
            if "[^" in line and '\\"' in line:  # a class of string characters
                assert "\\0-\\x1f" in line, line


@pytest.mark.parametrize(
    "params, surrogate, valid",
    [
        (StructuredOutputsParams(json={"type": "string", "maxLength": 4}), b'"\xed\xba\x96"', '"\u00e9"'),
        (StructuredOutputsParams(json={"type": "array", "items": {}}), b'["\xed\xa0\x80"]', '["é"]'),
        (StructuredOutputsParams(regex="a.b"), b"a\xed\xbf\xbfb", "a\U0001f600b"),
        (StructuredOutputsParams(grammar='root ::= "[" [^a]* "]"'), b"[\xed\xba\x96]", "[\u00e9\ud7ff]"),
    ],
)
def test_no_grammar_spells_a_surrogate(params, surrogate, valid):
    """xgrammar's classes cover U+D800-U+DFFF, which a byte-level tokenizer can spell as three bytes
    that are not UTF-8 (they detokenize to U+FFFD and break maxLength); every grammar refuses them
    and still takes the characters around them."""
    from xgrammar.testing import _get_matcher_from_grammar

    grammar = grammar_of(grammar_spec(params))

    def accepts(text: bytes) -> bool:
        matcher = _get_matcher_from_grammar(grammar)
        return matcher.accept_string(text) and matcher.is_terminated()

    assert not accepts(surrogate)
    assert accepts(valid.encode())


def test_a_grammar_waits_for_the_end_of_the_thinking():
    """With a reasoning parser, a thinking request's bitmask row allows every token and its tokens
    bypass the matcher; after the end marker the grammar constrains; where the model may choose to
    think (Qwen3), its first row also allows the start marker."""
    folder = str(ensure_demo_model())
    tokenizer = load_tokenizer(folder)
    markers = ReasoningMarkers.of(REASONING_PARSERS["qwen3"], tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    manager = StructuredOutputManager(folder, 1024, [eos], reasoning=(markers, blank_token_test(tokenizer)))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "integer"}))

    def grammar_for(prompt: str):
        request = Request(prompt, tokenizer.encode(prompt), params)
        manager.add_request(request)
        grammar = request.structured_output
        grammar.matcher = manager._matcher(grammar.future.result(timeout=30))
        return grammar

    def allowed(grammar) -> set[int]:
        row = manager.fill_bitmask([grammar])[0].view(np.uint32)
        return {t for t in range(1024) if row[t // 32] >> (t % 32) & 1}

    digits = {tokenizer.convert_tokens_to_ids(d) for d in "123"}
    everything = set(range(1024))

    opened = grammar_for("<|im_start|>assistant\n<think>\n")  # the template opened the thinking
    assert allowed(opened) == everything
    for token in tokenizer.encode("some thoughts, not JSON"):
        assert opened.accept(token) and not opened.is_terminated
    assert opened.accept(markers.end_id)
    after = allowed(opened)
    letters = set(tokenizer.encode(" the model"))
    assert digits <= after and markers.start_id not in after and not letters & after
    assert opened.accept(tokenizer.convert_tokens_to_ids("7")) and opened.accept(eos) and opened.is_terminated

    optional = grammar_for("<|im_start|>assistant\n")
    first = allowed(optional)
    assert markers.start_id in first and digits <= first and not letters & first
    assert optional.accept(markers.start_id) and allowed(optional) == everything  # it chose to think

    answer = grammar_for("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert markers.start_id not in allowed(answer)
    assert not answer.accept(markers.start_id)
    manager.close()
