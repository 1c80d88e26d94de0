"""What the fuzzing found breaking an engine or its side-channel decoding, or the engine and its OpenAPI document
disagreeing on, each as the smallest trigger, kept as regression tests (all fixed); and the limits across fields
that the document cannot state (docs/openapi.md), each refused naming its field. The P/D findings that need a
cluster are in test_router_openapi.py, the side channel's read amplification in test_side_channel.py."""

from __future__ import annotations

import json
import urllib.request

import pytest

from pdserve.engine.engine_args import EngineArgs
from pdserve.kvtransfer import messages
from pdserve.models.demo import ensure_demo_model
from tests.fuzz.openapi_fuzz import chat_body, completion_body, get_json
from tests.pd.cluster import post
from tests.server.helpers import ServerThread


@pytest.fixture(scope="module")
def engine():
    # Its own engine: the last test here killed its core before the fix.
    model = str(ensure_demo_model())
    thread = ServerThread(EngineArgs(model=model, max_model_len=64, kv_cache_memory=16 << 20, device="cpu"))
    yield thread
    thread.close()


def _completion(engine, **fields) -> tuple[int, dict]:
    return post(f"{engine.running.url}/v1/completions", completion_body(**{"max_tokens": 4, **fields}))


def _chat(engine, **fields) -> tuple[int, dict]:
    return post(f"{engine.running.url}/v1/chat/completions", chat_body(**{"max_tokens": 2, **fields}))


# They used to reach core_client.add_request, whose msgpack encoding raised OverflowError: 500.
OVERFLOWS = {
    "seed_2**64": {"seed": 1 << 64},
    "seed_below_int64": {"seed": -(1 << 63) - 1},
    "seed_plus_choice_index": {"seed": (1 << 64) - 1, "n": 2},
    "top_k_2**64": {"top_k": 1 << 64},
    "stop_token_id_2**64": {"stop_token_ids": [1 << 64]},
}


@pytest.mark.parametrize("fields", OVERFLOWS.values(), ids=OVERFLOWS.keys())
def test_integers_beyond_64_bits_are_refused(engine, fields):
    status, answer = _completion(engine, **fields)
    assert status == 400, answer


# Arguments of transformers' apply_chat_template, and values its rendering cannot take: they used to raise
# TypeError or jinja2's TemplateSyntaxError (500).
TEMPLATE_KWARGS = {
    "tokenize": {"tokenize": True},
    "conversation": {"conversation": []},
    "template_syntax": {"chat_template": "{% for %}"},
    "template_not_a_string": {"chat_template": 1},
    "tools_not_a_list": {"tools": 1},
}


@pytest.mark.parametrize("kwargs", TEMPLATE_KWARGS.values(), ids=TEMPLATE_KWARGS.keys())
def test_chat_template_kwargs_that_cannot_render_are_refused(engine, kwargs):
    status, answer = _chat(engine, chat_template_kwargs=kwargs)
    assert status == 400, answer


@pytest.mark.parametrize("key", ["tokenizer", "messages", "add_generation_prompt"])
def test_chat_template_kwargs_named_like_pdserve_parameters_do_not_collide(engine, key):
    # They used to collide with apply_chat_template's own parameters (TypeError: 500). Now the rendering's own
    # arguments are refused, and any other name is a template variable.
    status, answer = _chat(engine, chat_template_kwargs={key: []})
    assert status == (200 if key == "tokenizer" else 400), answer


def test_tiny_top_p_keeps_the_top_token(engine):
    # top_p used to become a float32 0 below ~1e-45: every token masked, token 0 (<|endoftext|>) each step.
    # Keeping only the top token is greedy decoding.
    greedy = _completion(engine, temperature=0, max_tokens=6)
    tiny = _completion(engine, top_p=1e-300, seed=1, max_tokens=6)
    assert greedy[0] == tiny[0] == 200
    assert tiny[1]["choices"][0]["text"] == greedy[1]["choices"][0]["text"]


def test_tiny_repetition_penalty_samples_seen_tokens(engine):
    # A penalty below 1 boosts the tokens already seen (at 1e-30, short of the overflow, only the prompt's tokens
    # come out); the smaller the penalty, the stronger the boost.
    prompt = [100, 200, 300, 400]
    status, answer = _completion(engine, prompt=prompt, repetition_penalty=1e-300, temperature=1.0, seed=3, logprobs=0)
    assert status == 200, answer
    tokenizer = engine.running.server.processor.tokenizer
    assert set(answer["choices"][0]["logprobs"]["tokens"]) <= {tokenizer.decode([token]) for token in prompt}, answer


def test_whole_float_integers_are_taken(engine):
    # schemathesis sends integers as 2.0 (an integer by JSON Schema): refused before, a schema-valid request.
    status, answer = _completion(engine, max_tokens=2.0, n=2.0, prompt=[5.0, 6])
    assert status == 200 and len(answer["choices"]) == 2 and answer["usage"]["completion_tokens"] == 4, answer


def test_a_colocated_engine_ignores_kv_transfer_params(engine):
    # It takes no part in P/D transfers: the params used to make it a prefill leg (one token, no stream, n = 1).
    status, answer = _completion(
        engine, max_tokens=3, n=2, ignore_eos=True, kv_transfer_params={"do_remote_decode": True}
    )
    assert status == 200 and answer["usage"]["completion_tokens"] == 6 and answer["kv_transfer_params"] is None, answer
    request = urllib.request.Request(
        f"{engine.running.url}/v1/completions",
        data=json.dumps(completion_body(stream=True, kv_transfer_params={"do_remote_decode": True})).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.read().endswith(b"data: [DONE]\n\n")
    status, answer = _completion(engine, kv_transfer_params={"do_remote_prefill": True})  # no blocks to pull
    assert status == 200, answer


# The limits across fields that JSON Schema cannot state (docs/openapi.md): a 400 naming the field.
CROSS_FIELD = {
    "text_prompt_too_long": ("completions", {"prompt": " ".join(map(str, range(100)))}, "prompt"),
    "prompt_plus_max_tokens": ("completions", {"prompt": list(range(1, 41)), "max_tokens": 30}, "max_tokens"),
    "prompt_plus_default_max_tokens": ("completions", {"prompt": list(range(1, 61)), "max_tokens": None}, "max_tokens"),
    "chat_prompt_too_long": ("chat/completions", {"messages": [{"role": "user", "content": "x " * 100}]}, "messages"),
    "chat_prompt_plus_max_completion_tokens": (
        "chat/completions",
        {"max_completion_tokens": 60},
        "max_completion_tokens",
    ),
    "min_tokens_above_max_tokens": ("completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    "min_tokens_above_default_max_tokens": ("completions", {"min_tokens": 17, "max_tokens": None}, "min_tokens"),
    "prompts_times_n": ("completions", {"prompt": [[1]] * 300, "n": 16}, "n"),
}


@pytest.mark.parametrize(("endpoint", "fields", "param"), CROSS_FIELD.values(), ids=CROSS_FIELD.keys())
def test_cross_field_limits_are_refused_naming_the_field(engine, endpoint, fields, param):
    body = (chat_body if endpoint.startswith("chat") else completion_body)(**{"max_tokens": 4, **fields})
    status, answer = post(f"{engine.running.url}/v1/{endpoint}", body)
    assert status == 400 and answer["error"]["param"] == param, answer


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": 2, "max_tokens": 0}, "max_tokens"),  # the alias is checked even when overridden
        ({"chat_template_kwargs": {"tools": {}}}, "chat_template_kwargs"),  # transformers took any iterable
        ({"chat_template_kwargs": {"sanitize_control_tokens": True}}, "chat_template_kwargs"),
    ],
)
def test_chat_fields_the_document_bounds_are_refused(engine, fields, param):
    status, answer = _chat(engine, **fields)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_deeply_nested_side_channel_frame_decodes_to_none():
    # A frame nested beyond the recursion limit used to raise RecursionError out of messages.decode, into the
    # agent's catch-all (a logged traceback and a 10 ms stall per frame).
    frame = b"\x81\xa1a" * 1000  # 3000 bytes: maps nested 1000 deep
    assert len(frame) < messages.MAX_MESSAGE_BYTES
    assert messages.decode(frame) is None


def test_top_k_beyond_int64_does_not_kill_the_engine(engine):
    # Last in the module, should it come back: top_k in [2**63, 2**64) used to kill the engine core
    # (sampler.filter_logits: torch.tensor([top_k]) overflows), and through the router the decode engine too.
    status, answer = _completion(engine, top_k=1 << 63)
    assert status == 400, answer
    assert _completion(engine)[0] == 200
    assert get_json(f"{engine.running.url}/health")[0] == 200
