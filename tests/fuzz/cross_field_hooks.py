"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=tests/fuzz/cross_field_hooks.py``) that keep schema-valid requests
within the limits across fields that JSON Schema cannot state, the exceptions docs/openapi.md lists, each of which
the server refuses with a 400 naming the field:

- a prompt has fewer tokens than the context length (``prompt`` / ``messages``; text is counted by the tokenizer);
- its tokens plus ``max_tokens`` (16 by default for completions) fit the context (``max_tokens`` /
  ``max_completion_tokens``);
- ``min_tokens`` is at most ``max_tokens``;
- prompts x ``n`` of one request is at most what the engine runs at once (``n``);
- P/D engines only: ``remote_block_generations`` has one entry per ``remote_block_ids`` entry;
- ``response_format`` (other than text) and ``structured_outputs`` are not both given, and the constraint is one
  xgrammar can enforce (its regex and EBNF syntax, the JSON-schema keywords it supports);
- chat: ``tool_choice`` is one the tools can serve (tools given, a named function among them, distinct names, "auto"
  only with a tool-call parser, forced functions' parameter schemas enforceable), and the history's tool-call
  arguments are JSON.

Schema-valid requests beyond one are brought within it (the smallest change: a lower ``max_tokens``, ``min_tokens``
or ``n``, a shorter block list, no ``response_format`` beside ``structured_outputs``), or, for a prompt too long for
any output or a constraint that cannot be enforced, not sent. Everything else, and every
schema-invalid request, is sent as generated, with every check at its defaults. The limits come from the
document's ``x-pdserve-limits``; prompts are counted with the tokenizer at ``PDSERVE_FUZZ_TOKENIZER`` (default:
the demo model's).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import schemathesis
from schemathesis import GenerationMode

from pdserve.api.chat import conversation
from pdserve.api.openapi import read_limits
from pdserve.api.protocol import ChatCompletionRequest, ProtocolError, decode_request
from pdserve.api.tokenizer import apply_chat_template, encode_prompt, load_tokenizer
from pdserve.engine.grammar import check_grammar, grammar_spec
from pdserve.engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from pdserve.server.tools import tool_use

DEFAULT_COMPLETION_MAX_TOKENS = 16
_GENERATION = ("/v1/completions", "/v1/chat/completions")


@functools.cache
def _tokenizer() -> Any:
    path = os.environ.get("PDSERVE_FUZZ_TOKENIZER")
    if path is None:
        from pdserve.models.demo import ensure_demo_model

        path = str(ensure_demo_model())
    return load_tokenizer(path)


def _applies(context: Any, case: Any) -> bool:
    meta = case.meta
    return (
        context.operation is not None
        and context.operation.path in _GENERATION
        and meta is not None
        and meta.generation.mode is GenerationMode.POSITIVE
        and isinstance(case.body, dict)
    )


def _prompt_lengths(path: str, body: dict[str, Any]) -> list[int] | None:
    """Each prompt's token count as the engine counts it; None if it cannot be rendered (the server says why)."""
    tokenizer = _tokenizer()
    if path == "/v1/chat/completions":
        try:
            messages, template_kwargs = conversation(_chat_request(body))
            ids = apply_chat_template(
                tokenizer, messages, body.get("add_generation_prompt") is not False, template_kwargs
            )
        except (ValueError, ProtocolError):
            return None
        return [len(ids)]
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [len(encode_prompt(tokenizer, prompt))]
    if prompt and isinstance(prompt[0], int | float):  # token ids (whole floats are integers too)
        return [len(prompt)]
    return [len(encode_prompt(tokenizer, item)) if isinstance(item, str) else len(item) for item in prompt]


@schemathesis.hook
def filter_case(context, case) -> bool:
    """A prompt that leaves no room for one output token is refused whatever else the request says."""
    if not _applies(context, case):
        return True
    if not _enforceable(case.body):
        return False
    if context.operation.path == "/v1/chat/completions" and not _chat_servable(case.body):
        return False
    limits = read_limits(context.operation.schema.raw_schema)
    lengths = _prompt_lengths(context.operation.path, case.body)
    return limits is None or lengths is None or max(lengths) < limits.max_model_len


def _enforceable(body: dict[str, Any]) -> bool:
    """The request's structured-output constraint (if any) passes the engine's own check."""
    constraint = body.get("structured_outputs")
    response_format = body.get("response_format")
    if constraint is None and isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        constraint = None if schema is None else {"json": schema}
    if not isinstance(constraint, dict):
        return True
    try:
        check_grammar(grammar_spec(StructuredOutputsParams(**constraint)))
    except (SamplingParamsError, TypeError):
        return False
    return True


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def _chat_servable(body: dict[str, Any]) -> bool:
    """The request's conversation renders and its tool_choice can be served (by an engine without a tool parser)."""
    try:
        request = _chat_request(body)
        conversation(request)
        tool_use(request, None)
    except (ValueError, ProtocolError):
        return False
    return True


@schemathesis.hook
def map_case(context, case):
    if not _applies(context, case):
        return case
    limits = read_limits(context.operation.schema.raw_schema)
    lengths = _prompt_lengths(context.operation.path, case.body)
    if limits is None or lengths is None or max(lengths) >= limits.max_model_len:
        return case
    body = case.body
    if body.get("structured_outputs") is not None:
        body.pop("response_format", None)
    room = limits.max_model_len - max(lengths)
    if context.operation.path == "/v1/chat/completions":
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(field)
    else:
        field, max_tokens = "max_tokens", body.get("max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    if max_tokens is not None and max_tokens > room:
        body[field] = max_tokens = room
    if max_tokens is not None and body.get("min_tokens") is not None and body["min_tokens"] > max_tokens:
        body["min_tokens"] = max_tokens
    n = body.get("n")
    if n is not None and n * len(lengths) > limits.max_choices:
        body["n"] = max(1, limits.max_choices // len(lengths))
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_prefill") is True:
        ids, generations = params.get("remote_block_ids"), params.get("remote_block_generations")
        if isinstance(ids, list) and isinstance(generations, list):
            size = min(len(ids), len(generations))
            params["remote_block_ids"], params["remote_block_generations"] = ids[:size], generations[:size]
    return case
