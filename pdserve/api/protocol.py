"""OpenAI-compatible request and response schemas (msgspec structs), shared by the engine servers
and the router.

Requests are validated by decoding into these types: a wrong type or a missing field becomes a
:class:`ProtocolError` naming the field (HTTP 400). Optional fields accept JSON null, meaning
"use the default". Range checks of sampling values belong to SamplingParams; the same structs
also generate the API's OpenAPI document (``pdserve.api.openapi``, which states those ranges too).

``kv_transfer_params`` is a top-level, nullable object on requests and responses: the P/D
protocol's contract (docs/contracts.md), passed through unchanged by anything in between.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

# On a decode leg's answer: its kv_transfer_params were not used (the value says why) and the
# prompt was computed there; the router counts such a request as a fallback, not as disaggregated.
KV_PARAMS_REJECTED_HEADER = "X-PDServe-KV-Params-Rejected"

# ----- requests ------------------------------------------------------------------------------


class StreamOptions(Struct, omit_defaults=True):
    include_usage: bool | None = None


class JsonSchemaFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``response_format.json_schema``."""

    name: str
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` request object: exactly one constraint (checked by the engine's
    StructuredOutputsParams)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class _SamplingFields(Struct, kw_only=True):
    """Fields both endpoints share; None everywhere means "the default"."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    # Lower first (vLLM's); engines take it under --scheduling-policy priority. 64-bit, as the document says.
    priority: Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists (msgspec cannot
    # express that union directly; __post_init__ enforces it).
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list):
            kinds = {type(item) for item in self.prompt}
            if not self.prompt or len(kinds) > 1:
                raise ValueError(
                    "`prompt` must be a string, a non-empty list of strings, of token ids, or of "
                    "token-id lists (not a mix)"
                )


class TextContentPart(Struct, kw_only=True):
    type: Literal["text"]
    text: str


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str  # JSON text of the arguments


class ToolCall(Struct, kw_only=True):
    """A call of one of the request's tools: in an assistant message of the history, or in an answer."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The message's content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# Arguments of the chat template's rendering itself (transformers' apply_chat_template): a client's
# chat_template_kwargs may only add template variables, and ``tools`` and ``documents`` (lists of objects).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
TEMPLATE_LIST_KWARGS = ("tools", "documents")


class FunctionDefinition(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    """``tool_choice`` naming the one function the answer must call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ----- responses -----------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    """OpenAI's legacy completion logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    top_logprobs: list[TopLogprob]
    bytes: list[int] | None = None


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking, apart from the answer (with a reasoning parser)
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"
    kv_transfer_params: dict[str, Any] | None = None


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None  # the next fragment of the arguments' JSON text


class DeltaToolCall(Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of a tool call: its first one carries the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


# ----- errors --------------------------------------------------------------------------------


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class HeldBlocks(Struct):
    """The part of a prefill leg's ``kv_transfer_params`` that names its held blocks (other fields pass)."""

    remote_request_id: str


class KVReleaseRequest(Struct):
    """POST /v1/kv_transfer/release on a prefill engine: free the blocks a prefill leg's answer named,
    because no decode leg will pull them (the router's client left between the legs)."""

    kv_transfer_params: HeldBlocks


class KVReleaseResponse(Struct):
    released: str  # the request id whose held blocks are freed (if it still held any)


class ErrorResponse(Struct):
    error: ErrorBody


class ProtocolError(Exception):
    """A request the API refuses, with what the client needs to fix it."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.error_type = error_type
        self.retry_after = retry_after  # seconds, sent as the Retry-After header (503 overload, draining)
        self._headers = headers or {}

    @property
    def headers(self) -> dict[str, str]:
        retry = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        return {**self._headers, **retry}

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.error_type, self.param, self.status))


_ERROR_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_OWN_CHECK_FIELD = re.compile(r"^`(\w+)` ")  # our __post_init__ checks name their field first
_CONTENT_PART_TYPE = re.compile(r"^Invalid enum value '([^']*)' - at `\$\.messages\[\d+\]\.content\[\d+\]\.type`$")


def decode_request(body: bytes, request_type: type[Struct]) -> Any:
    """Decode and validate a JSON request body, or raise ProtocolError naming the bad field.

    A whole number written as a float (``3.0``) is an integer by JSON Schema, so integer fields take it too."""
    try:
        try:
            return msgspec.json.decode(body, type=request_type)
        except msgspec.ValidationError as error:
            if "got `float`" not in str(error):
                raise
            # Rare, so decoded twice: the strict decoder stays the fast path.
            return msgspec.convert(_whole_floats_as_ints(msgspec.json.decode(body)), type=request_type)
    except msgspec.ValidationError as error:
        message = str(error)
        part = _CONTENT_PART_TYPE.match(message)
        if part is not None:  # an image, audio or file part: say why, not only where
            where = message[message.index(" - at") :]
            message = (
                f"content parts of type {part.group(1)!r} are not supported: models are served text-only "
                f"(a vision-language checkpoint's text model); send parts of type 'text'{where}"
            )
        match = _ERROR_PATH.search(message) or _OWN_CHECK_FIELD.search(message)
        raise ProtocolError(message, param=(match.group(1) or None) if match else None) from error
    except msgspec.DecodeError as error:
        raise ProtocolError(f"the body is not valid JSON: {error}") from error


def _whole_floats_as_ints(value: Any, top_level: bool = True) -> Any:
    """``value`` with every whole float an int, except in chat_template_kwargs (template variables, as sent)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_whole_floats_as_ints(item, False) for item in value]
    if isinstance(value, dict):
        return {
            key: item if top_level and key == "chat_template_kwargs" else _whole_floats_as_ints(item, False)
            for key, item in value.items()
        }
    return value


# ----- server-sent events --------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: Struct) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"
