"""The OpenAI protocol types: what decodes, what is refused (with the field named), and the shapes
that go back to clients."""

from __future__ import annotations

import json

import msgspec
import pytest

from pdserve.api.protocol import (
    SSE_DONE,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    ProtocolError,
    Usage,
    decode_request,
    sse_event,
)


@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_forms(prompt):
    request = decode_request(json.dumps({"model": "m", "prompt": prompt}).encode(), CompletionRequest)
    assert request.prompt == prompt


def test_nulls_mean_defaults_and_kv_transfer_params_pass_through():
    body = {
        "prompt": "x",
        "temperature": None,
        "max_tokens": None,
        "stop": None,
        "stream_options": None,
        "kv_transfer_params": {"do_remote_decode": True, "custom": [1, {"a": 2}]},
    }
    request = decode_request(json.dumps(body).encode(), CompletionRequest)
    assert request.temperature is None and request.max_tokens is None
    assert request.kv_transfer_params == body["kv_transfer_params"]


def test_chat_messages_with_text_parts():
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
            {"role": "assistant", "content": None},
        ],
        "max_completion_tokens": 5,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    assert [m.text() for m in request.messages] == ["Be brief.", "Hello", ""]
    assert request.stream_options.include_usage is True


@pytest.mark.parametrize(
    ("body", "request_type", "param"),
    [
        (b"{not json", CompletionRequest, None),
        (b"[]", CompletionRequest, None),
        (b'{"model": "m"}', CompletionRequest, None),  # prompt missing
        (b'{"prompt": "x", "max_tokens": "ten"}', CompletionRequest, "max_tokens"),
        (b'{"prompt": "x", "temperature": "hot"}', CompletionRequest, "temperature"),
        (b'{"prompt": [1, "a"]}', CompletionRequest, "prompt"),
        (b'{"prompt": []}', CompletionRequest, "prompt"),
        (b'{"prompt": [true]}', CompletionRequest, "prompt[0]"),
        (b'{"prompt": "x", "stop": 5}', CompletionRequest, "stop"),
        (b'{"messages": "hi"}', ChatCompletionRequest, "messages"),
        (b'{"messages": [{"content": "hi"}]}', ChatCompletionRequest, "messages[0]"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]}',
            ChatCompletionRequest,
            "messages[0].content[0].type",
        ),
        (b'{"messages": [], "logprobs": 3}', ChatCompletionRequest, "logprobs"),
    ],
)
def test_bad_requests_name_the_field(body, request_type, param):
    with pytest.raises(ProtocolError) as caught:
        decode_request(body, request_type)
    error = caught.value
    assert error.status == 400 and error.param == param
    payload = json.loads(msgspec.json.encode(error.to_response()))
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == "invalid_request_error"


def test_an_image_part_is_refused_as_unsupported_content():
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    with pytest.raises(ProtocolError) as caught:
        decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    assert caught.value.status == 400 and caught.value.param == "messages[0].content[0].type"
    assert "content parts of type 'image_url' are not supported: models are served text-only" in str(caught.value)


def test_whole_floats_are_integers():
    # 3.0 is an integer by JSON Schema (what the OpenAPI document promises), so integer fields take it.
    body = b'{"prompt": [1.0, 2], "n": 2.0, "max_tokens": 3.0, "temperature": 1.0, "seed": -4.0}'
    request = decode_request(body, CompletionRequest)
    assert (request.prompt, request.n, request.max_tokens, request.seed) == ([1, 2], 2, 3, -4)
    assert all(type(value) is int for value in (*request.prompt, request.n, request.max_tokens, request.seed))
    chat = b'{"messages": [{"role": "user"}], "top_logprobs": 1.0, "chat_template_kwargs": {"x": 1.0}}'
    request = decode_request(chat, ChatCompletionRequest)
    assert request.top_logprobs == 1 and type(request.chat_template_kwargs["x"]) is float  # template variables as sent
    with pytest.raises(ProtocolError) as caught:
        decode_request(b'{"prompt": "x", "n": 2.5}', CompletionRequest)
    assert caught.value.param == "n"


def test_response_shapes():
    response = CompletionResponse(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[CompletionChoice(0, "hi", finish_reason="length")],
        usage=Usage(2, 1, 3, PromptTokensDetails(cached_tokens=2)),
    )
    payload = json.loads(msgspec.json.encode(response))
    assert payload["object"] == "text_completion"
    assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChatChunkChoice(0, ChatDelta(content="x"))])
    event = sse_event(chunk)
    assert event.startswith(b"data: {") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["choices"][0]["delta"] == {"content": "x"}  # no null role in a delta
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_schemas_generate_a_json_schema():
    _, components = msgspec.json.schema_components([CompletionRequest])
    assert "prompt" in components["CompletionRequest"]["properties"]
    assert "prompt" in components["CompletionRequest"]["required"]


def test_protocol_imports_without_torch():
    # The router imports these types; it must not pay for (or need) torch.
    import subprocess
    import sys

    code = (
        "import sys, pdserve.api.protocol, pdserve.api.openapi, pdserve.engine.block_hash; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
