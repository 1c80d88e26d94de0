"""Contracts copied by hand between the wire (pdserve/api/protocol.py) and the engine's parameters
(pdserve/engine/sampling_params.py), checked field for field: a field added to one side without its twin
fails here, not as a TypeError on every request that uses it (or as a field silently ignored)."""

from __future__ import annotations

import dataclasses
import typing

from pdserve.api.prefill_leg import ANSWER_FIELDS, ENDING_FIELDS, ROUTER_DROPPED, leg_body, leg_sampling
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, StructuredOutputs
from pdserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve.server.serving import SAMPLING_FIELDS

REQUESTS = (CompletionRequest, ChatCompletionRequest)
PARAMS_FIELDS = {field.name for field in dataclasses.fields(SamplingParams)}
# SamplingParams fields the serving layer sets from request fields of another name or shape:
# max_tokens (also max_completion_tokens), logprobs (chat: logprobs + top_logprobs), prompt_logprobs
# (completions: echo + logprobs), structured_outputs (also response_format and forced tool calls).
CONVERTED = {"max_tokens", "logprobs", "prompt_logprobs", "structured_outputs"}
# SamplingParams fields no request field sets (the engine's defaults serve every HTTP request).
ENGINE_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"}


def test_structured_outputs_on_the_wire_and_in_the_engine_are_field_for_field_twins():
    # input_processor.structured_outputs_from copies one into the other by field name.
    wire = typing.get_type_hints(StructuredOutputs)
    engine = typing.get_type_hints(StructuredOutputsParams)
    assert list(wire) == list(StructuredOutputs.__struct_fields__)
    assert wire == engine
    engine_defaults = {field.name: field.default for field in dataclasses.fields(StructuredOutputsParams)}
    assert dict(zip(StructuredOutputs.__struct_fields__, StructuredOutputs.__struct_defaults__, strict=True)) == (
        engine_defaults
    )


def test_every_sampling_parameter_is_copied_from_the_request_or_set_on_purpose():
    assert len(set(SAMPLING_FIELDS)) == len(SAMPLING_FIELDS)
    assert set(SAMPLING_FIELDS) <= PARAMS_FIELDS
    assert not set(SAMPLING_FIELDS) & (CONVERTED | ENGINE_ONLY)
    # Every SamplingParams field is accounted for: a new one is copied from a request field, converted, or
    # declared engine-only above.
    assert set(SAMPLING_FIELDS) | CONVERTED | ENGINE_ONLY == PARAMS_FIELDS
    for request in REQUESTS:
        wire = set(request.__struct_fields__)
        # Every copied field is on the wire; every wire field named like a SamplingParams field is copied
        # (or converted): a new one cannot be silently ignored.
        assert set(SAMPLING_FIELDS) <= wire, request
        assert wire & PARAMS_FIELDS <= set(SAMPLING_FIELDS) | CONVERTED, request
        assert not wire & ENGINE_ONLY, request


def test_the_prefill_leg_field_contract_names_request_and_sampling_fields():
    for request in REQUESTS:
        assert set(ENDING_FIELDS) | set(ANSWER_FIELDS) <= set(request.__struct_fields__), request
    # What could end a leg early reaches the engine's sampling: it is what the engine drops.
    assert set(ENDING_FIELDS) <= set(SAMPLING_FIELDS)
    assert set(ENDING_FIELDS) <= ROUTER_DROPPED
    body = {name: object() for name in (*ENDING_FIELDS, *ANSWER_FIELDS, "prompt", "temperature")}
    leg = leg_body(body, chat=False)
    assert not set(leg) & ROUTER_DROPPED and leg["max_tokens"] == 1 and leg["stream"] is False
    sampling = leg_sampling({name: object() for name in SAMPLING_FIELDS})
    assert not set(sampling) & set(ENDING_FIELDS) and sampling["max_tokens"] == 1 and sampling["ignore_eos"]
