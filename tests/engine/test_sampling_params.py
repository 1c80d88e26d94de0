"""SamplingParams: vLLM's names and defaults, clear errors for bad values."""

import pytest

from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams


def test_defaults_follow_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (params.max_tokens, params.min_tokens, params.ignore_eos, params.seed) == (16, 0, False, None)
    assert (params.stop, params.stop_token_ids, params.logprobs, params.prompt_logprobs) == ([], [], None, None)
    assert params.skip_special_tokens and not params.include_stop_str_in_output


def test_normalisation():
    params = SamplingParams(stop="###", top_k=-1, temperature=0.0, stop_token_ids=[5, 9])
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert params.is_greedy
    assert params.stop_token_id_set == frozenset({5, 9})
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", "all"),
        ("seed", 1.0),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("ignore_eos", "yes"),
    ],
)
def test_bad_values_raise_a_clear_error(field, value):
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field
    assert field in str(caught.value)


def test_min_tokens_may_not_exceed_max_tokens():
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_a_json_schema_with_integers_beyond_64_bits_crosses_to_the_core():
    # Found by schemathesis (make test-slow, 2026-12-04): a response_format schema holding 27858382735335139311616
    # made the API process's msgpack encoding of the request raise, an HTTP 500. The schema now travels as text.
    import json

    import msgspec

    from pdserve.engine.grammar import grammar_spec

    schema = {"type": "object", "properties": {"n": {"enum": [27858382735335139311616, -(2**70)]}}}
    params = StructuredOutputsParams(json=schema)
    assert isinstance(params.json, str)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=StructuredOutputsParams)
    assert json.loads(grammar_spec(decoded).text) == schema
