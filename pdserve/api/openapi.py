"""The OpenAPI 3.1 document of the engines' and the router's HTTP API (``GET /openapi.json``).

Request and response shapes come from the msgspec structs of :mod:`pdserve.api.protocol`, the types requests are
decoded with. The value ranges the server checks after decoding (SamplingParams, the input processor, the serving
layer) are stated here too, so a request the document calls valid is one the server takes, and one it calls
invalid is refused: schemathesis checks both (docs/openapi.md). What a deployment decides (context length,
vocabulary, how many choices it runs) is an :class:`ApiLimits`: an engine states its own, the router repeats those
of its decode pods. Limits across fields that JSON Schema cannot state are listed in docs/openapi.md; each is
refused with a 400 naming the field.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import msgspec

from pdserve.api.protocol import (
    RESERVED_TEMPLATE_KWARGS,
    TEMPLATE_LIST_KWARGS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    KVReleaseRequest,
    KVReleaseResponse,
    ModelList,
)

# Where an engine's document carries its ApiLimits, for the router to read.
LIMITS_KEY = "x-pdserve-limits"
MAX_BODY_BYTES = 4 << 20  # of a request body, engines and router alike (413 beyond)

_INT32_MAX = (1 << 31) - 1  # integers SamplingParams takes into torch tensors
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1  # what msgspec decodes as an integer
_REF = "#/components/schemas/{name}"


class ApiLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one served model accepts beyond the shapes of the request types."""

    max_model_len: int  # prompt tokens + max_tokens; a prompt has at most max_model_len - 1 tokens
    vocab_size: int  # token ids are below it
    max_n: int  # choices per prompt
    max_logprobs: int  # logprobs and top_logprobs
    max_choices: int  # prompts x n of one request (the engine's --max-pending-requests)


def read_limits(document: Any) -> ApiLimits | None:
    """The limits an engine's document states; None if it states none (or is not a document)."""
    try:
        return msgspec.convert(document[LIMITS_KEY], ApiLimits)
    except (KeyError, TypeError, msgspec.ValidationError):
        return None


def openapi_document(
    title: str,
    version: str,
    *,
    server: Literal["engine", "router"],
    limits: ApiLimits | None = None,
    kv_transfer: bool = False,
    api_key: bool = False,
    priorities: bool = True,
) -> dict[str, Any]:
    """The document of an engine (``kv_transfer``: in a P/D role, taking ``kv_transfer_params``) or of the router.

    ``priorities`` False: an engine that schedules first come, first served, which takes priority 0 only.

    ``limits`` None: the deployment's limits are unknown (a router that has not reached a decode pod yet), and
    the fields they bound are stated without them. ``api_key``: /v1 and /debug need ``Authorization: Bearer``.
    """
    (
        (completion_req, chat_req, completion_resp, chat_resp, chat_chunk, models, error, release_req, release_resp),
        components,
    ) = msgspec.json.schema_components(
        [
            CompletionRequest,
            ChatCompletionRequest,
            CompletionResponse,
            ChatCompletionResponse,
            ChatCompletionChunk,
            ModelList,
            ErrorResponse,
            KVReleaseRequest,
            KVReleaseResponse,
        ],
        ref_template=_REF,
    )
    _constrain_requests(components, limits, server == "engine" and kv_transfer, server == "router", priorities)
    router = server == "router"
    responses = _Responses(error, router)
    protected: list[dict[str, list[str]]] | None = [{"bearer": []}] if api_key else None

    def generation(request_schema: dict, response_schema: dict, chunk_schema: dict, summary: str) -> dict:
        operation: dict[str, Any] = {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}},
            "responses": {
                "200": {
                    "description": "The result; with `stream: true`, a stream of server-sent events: one chunk "
                    "per event, an error object if the request fails once the stream has begun, then `[DONE]`",
                    "headers": responses.request_id_header(required=True),
                    "content": {
                        "application/json": {"schema": response_schema},
                        "text/event-stream": {"schema": _event_schema(chunk_schema, error)},
                    },
                },
                # The router's tenants (403: a gateway named one it lacks) and flow control (429).
                **responses.errors(400, 401, *((403,) if router else ()), 404, 413, *((429,) if router else ())),
                **responses.errors(500, 503, 504),
            },
        }
        return {"post": _secured(operation, protected)}

    paths: dict[str, Any] = {
        "/v1/completions": generation(completion_req, completion_resp, completion_resp, "Text completion"),
        "/v1/chat/completions": generation(chat_req, chat_resp, chat_chunk, "Chat completion"),
        "/v1/models": {
            "get": _secured(
                {
                    "summary": "The served model"
                    + (" (a decode pod's answer, relayed with its status)" if router else ""),
                    "responses": {
                        "200": {"description": "The model list", "content": {"application/json": {"schema": models}}},
                        **responses.errors(401, 500, *((503,) if router else ())),
                    },
                },
                protected,
            )
        },
        "/health": {"get": _health(responses, router)},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": _STRING}}},
                    **responses.errors(500),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {
                    "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": _OBJECT}}},
                    **responses.errors(500),
                },
            }
        },
    }
    if router:
        paths["/debug/index"] = {"get": _secured(_debug_index(responses), protected)}
    else:
        paths["/debug/cached_blocks"] = {"get": _secured(_debug_cached_blocks(responses), protected)}
    if kv_transfer and not router:
        paths["/v1/kv_transfer/release"] = {
            "post": _secured(
                {
                    "summary": "Free the blocks a prefill leg's answer named (no decode leg will pull them)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": release_req}}},
                    "responses": {
                        "200": {
                            "description": "The request whose held blocks are freed, if it still held any",
                            "content": {"application/json": {"schema": release_resp}},
                        },
                        **responses.errors(400, 401, 413, 500, 503),
                    },
                },
                protected,
            )
        }
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if limits is not None:
        document[LIMITS_KEY] = msgspec.to_builtins(limits)
    return document


# ----- requests ------------------------------------------------------------------------------


def _response_format() -> dict[str, Any]:
    return {
        "oneOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["text", "json_object"]}},
                "additionalProperties": False,
            },
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "schema": _nullable(
                                {"type": "object", "description": "A JSON schema xgrammar can enforce"}
                            ),
                            "strict": _nullable({"type": "boolean"}),
                            "description": _nullable({"type": "string"}),
                        },
                        "additionalProperties": False,
                    },
                },
                "additionalProperties": False,
            },
        ],
        "description": "OpenAI's response_format: free text, any JSON object, or JSON valid against a schema",
    }


def _structured_outputs() -> dict[str, Any]:
    """vLLM's structured_outputs: exactly one constraint (and the whitespace switch)."""
    constraints = {
        "json": {"anyOf": [{"type": "string"}, {"type": "object"}], "description": "A JSON schema"},
        "regex": {"type": "string", "description": "A regular expression in xgrammar's syntax"},
        "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "grammar": {"type": "string", "description": "An EBNF grammar in xgrammar's syntax"},
        "json_object": {"const": True},
    }
    whitespace = _nullable({"type": "boolean"})
    return {
        "oneOf": [
            {
                "type": "object",
                "required": [name],
                "properties": {name: schema, "disable_any_whitespace": whitespace},
                "additionalProperties": False,
            }
            for name, schema in constraints.items()
        ],
        "description": "Exactly one constraint on the output",
    }


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def _integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _constrain_requests(
    components: dict[str, Any], limits: ApiLimits | None, pd: bool, router: bool, priorities: bool
) -> None:
    """The request schemas with the ranges the server checks (SamplingParams, InputProcessor, OpenAIServing)."""
    completion = components["CompletionRequest"]
    chat = components["ChatCompletionRequest"]
    # A prompt and what it may generate share the context: at least one prompt token, at least one new one.
    max_new = limits.max_model_len - 1 if limits else _INT64_MAX
    token = _integer(0, limits.vocab_size - 1 if limits else _INT64_MAX)
    max_n = limits.max_n if limits else _INT32_MAX
    max_logprobs = limits.max_logprobs if limits else _INT64_MAX
    max_prompts = {"maxItems": limits.max_choices} if limits else {}
    non_empty = {"type": "string", "minLength": 1}
    shared = {
        "n": _nullable(_integer(1, max_n)),
        "temperature": _nullable({"type": "number", "minimum": 0}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable(_integer(-1, _INT32_MAX)),  # -1 and 0: no top-k
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
        "seed": _nullable(_integer(_INT64_MIN, _INT64_MAX)),
        # The router clamps any priority into the tenant's range; an fcfs engine would ignore one, so refuses it.
        "priority": _nullable(_integer(_INT64_MIN, _INT64_MAX) if priorities else _integer(0, 0)),
        "stop": _nullable({"anyOf": [non_empty, {"type": "array", "items": non_empty}]}),
        "stop_token_ids": _nullable({"type": "array", "items": _integer(0, _INT32_MAX)}),
        "max_tokens": _nullable(_integer(1, max_new)),
        "kv_transfer_params": _kv_transfer_params(pd, router),
        "response_format": _nullable(_response_format()),
        "structured_outputs": _nullable(_structured_outputs()),
    }
    for request in (completion, chat):
        request["properties"].update(shared)
    token_ids = {"type": "array", "minItems": 1, "items": token}
    if limits:
        token_ids["maxItems"] = limits.max_model_len - 1
    completion["properties"].update(
        prompt={
            "anyOf": [
                non_empty,
                {"type": "array", "minItems": 1, "items": non_empty, **max_prompts},
                token_ids,
                {"type": "array", "minItems": 1, "items": token_ids, **max_prompts},
            ],
            "description": "Text, token ids, or several prompts of either kind (one kind per request)",
        },
        # At most max_tokens, which defaults to 16 here.
        min_tokens=_nullable(_integer(0, min(max_new, _INT32_MAX))),
        logprobs=_nullable(_integer(0, max_logprobs)),
    )
    reserved = {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}
    object_list = _nullable({"type": "array", "items": {"type": "object"}})
    chat["properties"].update(
        messages={"type": "array", "minItems": 1, "items": {"$ref": _REF.format(name="ChatMessage")}},
        # Chat has no default max_tokens: without one, min_tokens has no upper bound but its type's.
        min_tokens=_nullable(_integer(0, _INT32_MAX)),
        max_completion_tokens=_nullable(_integer(1, max_new)),
        top_logprobs=_nullable(_integer(0, max_logprobs)),
        chat_template_kwargs=_nullable(
            {
                "type": "object",
                "propertyNames": reserved,
                "properties": dict.fromkeys(TEMPLATE_LIST_KWARGS, object_list),
                "description": "Extra variables for the chat template",
            }
        ),
    )
    components["FunctionDefinition"]["properties"]["name"] = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
    if pd:
        for request in (completion, chat):
            request["allOf"] = copy.deepcopy(_PD_CONDITIONS)


def _kv_transfer_params(pd: bool, router: bool) -> dict[str, Any]:
    if router:
        return _nullable({"type": "object", "description": "Ignored: the P/D protocol is the router's own"})
    if not pd:
        return _nullable({"type": "object", "description": "Ignored: this engine takes no part in P/D transfers"})
    text = {"type": "string"}
    ids = {"type": "array", "items": _integer(0, _INT64_MAX)}
    decode_leg = {
        "type": "object",
        "description": "A decode leg: where the prefilled blocks are (a prefill engine's answer, passed on)",
        "properties": {
            "do_remote_prefill": {"const": True},
            "remote_engine_id": text,
            "remote_request_id": text,
            "remote_host": text,
            "remote_port": _integer(1, 65535),
            "remote_ports": {"type": "array", "items": _integer(1, 65535), "minItems": 1, "maxItems": 64},
            "remote_block_ids": ids,
            "remote_block_generations": ids,
            "remote_num_tokens": _integer(_INT64_MIN, _INT64_MAX),
            "remote_prompt_hash": text,
            "kv_compat_hash": text,
            "remote_lease_seconds": {"type": "number", "exclusiveMinimum": 0},
        },
        "required": [
            "do_remote_prefill",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "remote_block_ids",
            "remote_block_generations",
            "remote_num_tokens",
            "remote_prompt_hash",
            "kv_compat_hash",
            "remote_lease_seconds",
        ],
    }
    other = {
        "type": "object",
        "description": "Anything else; `do_remote_decode: true` makes a prefill leg (one token, blocks held)",
        "properties": {"do_remote_prefill": {"not": {"const": True}}},
    }
    return {
        "anyOf": [decode_leg, other, {"type": "null"}],
        "default": None,
        "description": "The P/D protocol's parameters (docs/contracts.md), set by the router",
    }


# A P/D engine: P/D parameters carry one sequence's blocks (n = 1), and a prefill leg answers with its parameters
# in one JSON body (no stream).
_PD_CONDITIONS = [
    {
        "if": {
            "required": ["kv_transfer_params"],
            "properties": {"kv_transfer_params": {"type": "object", "minProperties": 1}},
        },
        "then": {"properties": {"n": {"anyOf": [{"const": 1}, {"type": "null"}]}}},
    },
    {
        "if": {
            "required": ["kv_transfer_params"],
            "properties": {
                "kv_transfer_params": {
                    "type": "object",
                    "required": ["do_remote_decode"],
                    "properties": {"do_remote_decode": {"const": True}},
                }
            },
        },
        "then": {"properties": {"stream": {"not": {"const": True}}}},
    },
]


# ----- responses -----------------------------------------------------------------------------

_STRING = {"type": "string"}
_OBJECT = {"type": "object"}
_STATUS = {"type": "object", "properties": {"status": _STRING}, "required": ["status"]}

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field of the wrong type or out of range, or a limit across fields (docs/openapi.md) "
    "exceeded; `error.param` names the field",
    401: "Missing or wrong API key (servers started with one)",
    403: "The tenant a trusted gateway named is not in the router's tenant table (and it has no default entry)",
    404: "The model is not served here",
    413: f"The body is larger than {MAX_BODY_BYTES >> 20} MiB",
    429: "Refused by the router's flow control: the tenant's requests or tokens per minute, a full queue, or a queue "
    "deadline passed while the fleet was saturated (retry after `Retry-After` seconds)",
    500: "Internal error",
    503: "Unavailable: overloaded or shutting down (retry after `Retry-After` seconds, maybe elsewhere), or the "
    "engine core is not running",
    504: "The request did not finish within the server's --request-timeout",
}


class _Responses:
    def __init__(self, error_schema: dict[str, Any], router: bool) -> None:
        self.error_schema = error_schema
        self.router = router

    def request_id_header(self, required: bool) -> dict[str, Any]:
        if not self.router:
            return {}
        return {
            "X-Request-Id": {
                "description": "The request's id (the client's own X-Request-Id, or one the router made)",
                "required": required,
                "schema": _STRING,
            }
        }

    def errors(self, *statuses: int) -> dict[str, Any]:
        answers = {}
        for status in statuses:
            headers = self.request_id_header(required=False)
            if status in (429, 503):
                headers["Retry-After"] = {"description": "Seconds to wait before retrying", "schema": _STRING}
            answer: dict[str, Any] = {
                "description": _ERROR_DESCRIPTIONS[status],
                "content": {"application/json": {"schema": self.error_schema}},
            }
            if headers:
                answer["headers"] = headers
            answers[str(status)] = answer
        return answers


def _event_schema(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1: the media type's schema describes each event)."""
    return {
        "type": "object",
        "properties": {
            "event": {"const": "message"},  # events carry no type of their own
            "data": {
                "anyOf": [
                    {"const": "[DONE]", "description": "The last event"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [chunk, error]},
                    },
                ]
            },
        },
        "required": ["data"],
    }


def _secured(operation: dict[str, Any], security: list[dict[str, list]] | None) -> dict[str, Any]:
    if security is not None:
        operation["security"] = security
    return operation


def _health(responses: _Responses, router: bool) -> dict[str, Any]:
    if router:
        healthy = _STATUS
        unhealthy = "No decode pod is up"
    else:
        # Routers learn here where the engine publishes its KV-cache events.
        healthy = {
            "type": "object",
            "properties": {"status": {"const": "ok"}, "kv_events_port": _nullable(_integer(1, 65535))},
            "required": ["status", "kv_events_port"],
        }
        unhealthy = "The engine core is not running, or the engine is shutting down"
    return {
        "summary": "Whether the " + ("router can serve" if router else "engine serves"),
        "responses": {
            "200": {"description": "Serving", "content": {"application/json": {"schema": healthy}}},
            "503": {"description": unhealthy, "content": {"application/json": {"schema": _STATUS}}},
            **responses.errors(500),
        },
    }


def _debug_cached_blocks(responses: _Responses) -> dict[str, Any]:
    return {
        "summary": "Every block hash in the engine's prefix cache",
        "description": "For checking what routers believe (their /debug/index) against the truth",
        "responses": {
            "200": {
                "description": "The block size and the cached blocks' hashes (hex)",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "block_size": {"type": "integer", "minimum": 1},
                                "block_hashes": {
                                    "type": "array",
                                    "items": {"type": "string", "pattern": "^[0-9a-f]*$"},
                                },
                            },
                            "required": ["block_size", "block_hashes"],
                        }
                    }
                },
            },
            **responses.errors(401, 500, 503),
        },
    }


def _debug_index(responses: _Responses) -> dict[str, Any]:
    load = {
        "type": "object",
        "properties": {
            "num_running": {"type": "integer"},
            "num_waiting": {"type": "integer"},
            "num_waiting_for_remote_kv": {"type": "integer"},
            "kv_cache_usage": {"type": "number"},
            "num_blocks_held_for_remote": {"type": "integer"},
        },
    }
    pod = {
        "type": "object",
        "properties": {
            "engine_id": _STRING,
            "block_size": {"type": "integer"},
            "num_blocks": {"type": "integer", "minimum": 0},
            "media": {
                "type": "object",
                "description": "Blocks per medium the pod reports: engine (its pool) and its KV tiers (host, disk, "
                "shared)",
                "additionalProperties": {"type": "integer", "minimum": 0},
            },
            "stale": {"type": "boolean"},
            "seq": {"type": "integer"},
            "age_s": {"type": "number"},
            "load": {"anyOf": [load, {"type": "null"}]},
            "block_hashes": {"type": "array", "items": _STRING},
            "tier_block_hashes": {"type": "object", "additionalProperties": {"type": "array", "items": _STRING}},
        },
        "required": ["engine_id", "block_size", "num_blocks", "media", "stale", "seq", "age_s", "load"],
    }
    return {
        "summary": "What the router believes each pod has cached, and its load",
        "parameters": [
            {
                "name": "hashes",
                "in": "query",
                "required": False,
                "description": "Anything but empty, 0 or false: list each pod's block hashes (hex) too",
                "schema": _STRING,
            }
        ],
        "responses": {
            "200": {
                "description": "Per pod URL, from the KV-cache events it published",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "routing": _STRING,
                                "prefix_aware": {"type": "boolean"},
                                "subscriptions": {
                                    "type": "object",
                                    "additionalProperties": {"anyOf": [_STRING, {"type": "null"}]},
                                },
                                "pods": {"type": "object", "additionalProperties": pod},
                            },
                            "required": ["routing", "prefix_aware", "subscriptions", "pods"],
                        }
                    }
                },
            },
            **responses.errors(401, 500),
        },
    }
