"""Serving completions and chat completions: each request is checked (model, admission, prompts,
sampling), run as one core request per choice (``choices.ChoiceRunner``), and answered as one JSON
response or streamed as SSE events.

A P/D decode leg refused at the door (a body that does not decode, a bad value) tells its prefill
engine to free the blocks it holds for it; one refused for now (503: overload, draining) does not,
since the router may send it to another decode engine.

P/D params (``do_remote_decode``, ``do_remote_prefill``) make this engine hold KV for others or
connect to a peer the params name, so with keys they are taken only from the router: its signed
``X-PDServe-Router-Auth`` header (pdserve/api/auth.py), made for this engine's id and checked before
anything else (a forged decode leg must not even make this engine release the blocks it names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from pdserve.api.auth import ENGINE_ID_HEADER, ROUTER_AUTH_HEADER, WRONG_TARGET, RouterVerifier
from pdserve.api.chat import ConversationError, conversation
from pdserve.api.http import json_response
from pdserve.api.prefill_leg import leg_sampling
from pdserve.api.protocol import (
    KV_PARAMS_REJECTED_HEADER,
    SSE_DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ProtocolError,
    Usage,
    decode_request,
    sse_event,
)
from pdserve.api.report import REPORT_HEADER, comment, header_value
from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from pdserve.kvtransfer.decode_side import unusable_reason
from pdserve.kvtransfer.params import parse_remote_prefill, wants_remote_decode
from pdserve.kvtransfer.prefill_side import is_prefill_leg
from pdserve.server.chat_output import ChatOutputReader, ChatParsers
from pdserve.server.choices import ChoiceRunner
from pdserve.server.core_client import EngineCoreClient
from pdserve.server.input_processor import InputError, InputProcessor, structured_outputs_from
from pdserve.server.metrics import EngineMetrics
from pdserve.server.responses import (
    Children,
    ChoiceResult,
    LogprobFormatter,
    end_stream_with_error,
    report,
    start_sse,
    usage,
)
from pdserve.server.tools import tool_use

MAX_N = 16
KV_PARAMS_REJECTED_KEY = web.RequestKey("kv_params_rejected", str)
RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def _leg_headers(request: web.Request) -> dict[str, str] | None:
    """Headers a decode leg's answer carries: why its params were not used, when they were not."""
    reason = request.get(KV_PARAMS_REJECTED_KEY)
    return {KV_PARAMS_REJECTED_HEADER: reason} if reason is not None else None


class _PDParamsOnly(msgspec.Struct):
    """A request body read for its P/D params alone (the rest may be invalid)."""

    kv_transfer_params: dict[str, Any] | None = None


def _kv_transfer_params_of(raw: bytes) -> dict[str, Any] | None:
    """The body's ``kv_transfer_params``, when it is a JSON object that has them as an object."""
    try:
        return msgspec.json.decode(raw, type=_PDParamsOnly).kv_transfer_params
    except msgspec.MsgspecError:
        return None


def _answer_headers(request: web.Request, children: Children, results: list[ChoiceResult]) -> dict[str, str] | None:
    """A JSON answer's headers: the leg's, and the request report when the router asked for it."""
    headers = _leg_headers(request)
    if request.headers.get(REPORT_HEADER) == "1":
        headers = {**(headers or {}), REPORT_HEADER: header_value(report(children, results))}
    return headers


async def _write_report(
    request: web.Request, response: web.StreamResponse, children: Children, results: list[ChoiceResult]
) -> None:
    """A stream's report comment, when the router asked for it (before the usage event and [DONE])."""
    if request.headers.get(REPORT_HEADER) == "1":
        await response.write(comment(report(children, results)))


# Request fields that become SamplingParams fields of the same name.
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
)


@dataclass
class ServerLimits:
    """Bounds that keep an overloaded or stopping server answering (every one a clear error)."""

    # Core requests (choices) in flight beyond which new requests get 503 + Retry-After: the
    # engine's waiting queue stays bounded, and a router can send the request elsewhere.
    max_in_flight: int = 4096
    request_timeout: float | None = None  # seconds for a whole request; None: unbounded
    retry_after: int = 1  # seconds, in 503 answers


class OpenAIServing:
    def __init__(
        self,
        client: EngineCoreClient,
        processor: InputProcessor,
        model_name: str,
        metrics: EngineMetrics,
        limits: ServerLimits,
        kv_transfer: bool = False,
        serves_blocks: bool = False,
        router_verifier: RouterVerifier | None = None,
        chat_parsers: ChatParsers | None = None,
    ) -> None:
        self.client = client
        self.processor = processor
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits
        self.logprobs = LogprobFormatter(processor.tokenizer)
        self.choices = ChoiceRunner(client, processor, metrics, limits.request_timeout)
        self.draining = False  # set on shutdown: new requests are refused, running ones finish
        # A P/D role's engine speaks the P/D protocol; any other ignores kv_transfer_params (as vLLM does
        # without a KV connector): no prefill leg, no blocks to pull, nothing to check.
        self.kv_transfer = kv_transfer
        self.serves_blocks = serves_blocks  # takes prefill legs (holds blocks for peers): the prefill role
        # Checks that P/D params come from the router; None: taken from any client (an engine without keys).
        self.router_verifier = router_verifier
        self.chat_parsers = chat_parsers or ChatParsers()

    # ----- endpoints ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = await self._decode(request, raw, CompletionRequest)
        if not self.kv_transfer:
            body.kv_transfer_params = None
        self.check_pd_params(request, raw, body.kv_transfer_params)
        async with self._releasing_refused(body.kv_transfer_params):
            return await self._completions(request, body)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = await self._decode(request, raw, ChatCompletionRequest)
        if not self.kv_transfer:
            body.kv_transfer_params = None
        self.check_pd_params(request, raw, body.kv_transfer_params)
        async with self._releasing_refused(body.kv_transfer_params):
            return await self._chat_completions(request, body)

    def check_pd_params(self, request: web.Request, raw: bytes, kv_transfer_params: dict[str, Any] | None) -> None:
        """Refuse P/D params this engine must not act on: not from the router (403), or a prefill
        leg on an engine that hands its blocks to no peer (400)."""
        if not kv_transfer_params:
            return
        self.verify_router(request, raw)
        if wants_remote_decode(kv_transfer_params) and not self.serves_blocks:
            raise InputError(
                "kv_transfer_params", "this engine hands its KV to no peer (decode role): send prefill legs to prefill"
            )

    def verify_router(self, request: web.Request, raw: bytes) -> None:
        """403 unless the router signed this request (or nothing needs its signature)."""
        if self.router_verifier is None:
            return
        header = request.headers.get(ROUTER_AUTH_HEADER)
        problem = self.router_verifier.problem(header, request.method, request.path, raw)
        if problem == WRONG_TARGET:  # signed for another engine (or a previous run of this one)
            raise ProtocolError(
                f"this request was signed for another engine; this is engine {self.router_verifier.engine_id}",
                403,
                param="kv_transfer_params",
                error_type=WRONG_TARGET,
                headers={ENGINE_ID_HEADER: self.router_verifier.engine_id},
            )
        if problem is not None:
            raise ProtocolError(
                f"kv_transfer_params are taken only from the router (its {ROUTER_AUTH_HEADER} header: {problem})",
                403,
                param="kv_transfer_params",
                error_type="permission_denied",
            )

    async def _decode(self, request: web.Request, raw: bytes, request_type: type[RequestT]) -> RequestT:
        """The request's body. A decode leg's body that does not decode (``max_tokens: "ten"``, say:
        the prefill leg, sent with ``max_tokens`` 1, took it) still names its prefill engine's
        hold, which is freed now rather than at the lease's end."""
        try:
            return decode_request(raw, request_type)
        except ProtocolError as error:
            params = _kv_transfer_params_of(raw) if self.kv_transfer else None
            if params:
                self.verify_router(request, raw)
                await self._release_refused(params, error)
            raise

    @contextlib.asynccontextmanager
    async def _releasing_refused(self, kv_transfer_params: dict[str, Any] | None) -> AsyncIterator[None]:
        """A decode request refused here never reaches the scheduler, whose connector would
        otherwise tell the prefill engine to free the request's blocks: say it here, or they stay
        held until the lease ends."""
        try:
            yield
        except (ProtocolError, ValueError) as error:
            await self._release_refused(kv_transfer_params, error)
            raise

    async def _release_refused(self, kv_transfer_params: dict[str, Any] | None, error: Exception) -> None:
        """Free the prefill hold a refused decode leg names. Except when it is refused for now (503:
        overloaded, draining): the router retries such a refusal on another decode engine with the
        same params, which must still find the blocks held (if it gives up, the lease frees them)."""
        retryable = isinstance(error, ProtocolError) and error.status == 503
        if (
            kv_transfer_params
            and kv_transfer_params.get("do_remote_prefill") is True
            and not retryable
            and self.client.alive
        ):
            await self.client.release_remote_blocks(kv_transfer_params)

    async def _completions(self, request: web.Request, body: CompletionRequest) -> web.StreamResponse:
        self._check_model(body.model)
        prompts = [prompt.token_ids for prompt in self.processor.prompts(body.prompt)]
        echo = bool(body.echo)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = self._sampling_params(
            body,
            max_tokens,
            body.logprobs,
            prompt_logprobs=body.logprobs if echo and body.logprobs is not None else None,
        )
        for prompt in prompts:
            self.processor.check_max_tokens(prompt, params.max_tokens)
        if len(prompts) > 1 and wants_remote_decode(body.kv_transfer_params):
            # One prefill leg hands one prompt's blocks to one decode engine; the others would stay
            # held, unnamed, until their leases ended.
            raise InputError("prompt", "a prefill leg (kv_transfer_params.do_remote_decode) takes one prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        children = [(prompt, index * params.n + k) for index, prompt in enumerate(prompts) for k in range(params.n)]
        self._admit(len(children), "n" if params.n > 1 else "prompt")
        await self._screen_remote_prefill(request, body, prompts, params)
        if body.stream:
            return await self._stream_completion(request, body, request_id, children, params)
        results = await self.choices.gather(request_id, children, params, body.kv_transfer_params, body.cache_salt)
        choices = []
        for (prompt, index), result in zip(children, results, strict=True):
            text = result.text
            logprobs = None
            if body.logprobs is not None:
                entries: list[TokenLogprobs | None] = list(result.logprobs)
                if echo:
                    entries = [None, *(result.prompt_logprobs or []), *entries]
                logprobs = self.logprobs.completion(entries, prompt + result.token_ids if echo else result.token_ids)
            if echo:
                text = self.processor.tokenizer.decode(prompt) + text
            choices.append(CompletionChoice(index, text, logprobs, result.finish_reason, result.stop_reason))
        return json_response(
            headers=_answer_headers(request, children, results),
            payload=CompletionResponse(
                id=request_id,
                created=int(time.time()),
                model=self.model_name,
                choices=choices,
                usage=usage(children, results),
                kv_transfer_params=results[0].kv_transfer_params,
            ),
        )

    async def _chat_completions(self, request: web.Request, body: ChatCompletionRequest) -> web.StreamResponse:
        self._check_model(body.model)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= self.processor.max_logprobs:
            raise InputError("top_logprobs", f"top_logprobs must be between 0 and {self.processor.max_logprobs}")
        try:
            messages, template_kwargs = conversation(body)
        except ConversationError as error:
            raise InputError(error.param, str(error)) from error
        tools = tool_use(body, self.chat_parsers.tools)
        prompt = self.processor.chat_prompt(
            messages, body.add_generation_prompt is not False, template_kwargs
        ).token_ids
        max_tokens = body.max_tokens
        if body.max_completion_tokens is not None:
            # It wins; max_tokens, its deprecated alias, must still be a value the request could have used.
            if max_tokens is not None and not 1 <= max_tokens < self.processor.max_model_len:
                raise InputError("max_tokens", f"max_tokens must be between 1 and {self.processor.max_model_len - 1}")
            max_tokens = body.max_completion_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, logprobs, forced_tools=tools.constraint)
        self.processor.check_max_tokens(
            prompt,
            params.max_tokens,
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        children = [(prompt, k) for k in range(params.n)]
        self._admit(len(children), "n")
        await self._screen_remote_prefill(request, body, [prompt], params)
        readers = [self.chat_parsers.reader(prompt, tools) for _ in children]
        if body.stream:
            return await self._stream_chat(request, body, request_id, children, params, readers)
        results = await self.choices.gather(request_id, children, params, body.kv_transfer_params, body.cache_salt)
        choices = []
        for (_, index), result, reader in zip(children, results, readers, strict=True):
            message = ChatResponseMessage(content=result.text)
            finish_reason = result.finish_reason
            if reader is not None:
                message.reasoning_content, message.content, message.tool_calls = reader.whole(result.text)
                finish_reason = reader.finish_reason(finish_reason)
            logprobs_of = self.logprobs.chat(result.logprobs) if body.logprobs else None
            choices.append(ChatChoice(index, message, logprobs_of, finish_reason, result.stop_reason))
        return json_response(
            headers=_answer_headers(request, children, results),
            payload=ChatCompletionResponse(
                id=request_id,
                created=int(time.time()),
                model=self.model_name,
                choices=choices,
                usage=usage(children, results),
                kv_transfer_params=results[0].kv_transfer_params,
            ),
        )

    async def _screen_remote_prefill(
        self, request: web.Request, body: Any, prompts: list[list[int]], params: SamplingParams
    ) -> None:
        """A decode leg whose params cannot be used here (another model's KV, another prompt's, or
        prompt logprobs, which need the prompt's logits) is computed here instead: the prefill
        engine is told to free, the rejection counted, and the answer says so in a header, so the
        router does not count it as disaggregated."""
        remote = parse_remote_prefill(body.kv_transfer_params)  # validated already
        if remote is None:
            return
        if len(prompts) > 1:
            reason: str | None = "several_prompts"
        else:
            ready = self.client.ready
            reason = unusable_reason(remote, prompts[0], ready.kv_compat_hash, params.prompt_logprobs is not None)
        if reason is None:
            return
        await self.client.release_remote_blocks(body.kv_transfer_params)
        body.kv_transfer_params = None
        self.metrics.kv_params_rejected.labels(reason).inc()
        request[KV_PARAMS_REJECTED_KEY] = reason

    # ----- admission and validation -------------------------------------------------------------

    def _admit(self, num_choices: int, param: str) -> None:
        """Refuse new work while draining or when the engine already has too much in flight; a request
        more than an idle engine would take is the client's to change (400 naming ``param``)."""
        if num_choices > self.limits.max_in_flight:
            raise InputError(
                param,
                f"the request asks for {num_choices} choices (prompts x n); this server runs at most "
                f"{self.limits.max_in_flight} at once",
            )
        if self.draining:
            raise ProtocolError(
                "the server is shutting down; retry on another replica",
                503,
                error_type="service_unavailable",
                retry_after=self.limits.retry_after,
            )
        if self.client.num_in_flight + num_choices > self.limits.max_in_flight:
            raise ProtocolError(
                f"the server is overloaded ({self.client.num_in_flight} requests in flight); retry later",
                503,
                error_type="service_unavailable",
                retry_after=self.limits.retry_after,
            )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ProtocolError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                error_type="not_found_error",
            )

    def _sampling_params(
        self,
        body: Any,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        forced_tools: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """``forced_tools``: the grammar of a forced tool call (tool_choice "required" or named)."""
        fields = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
        fields.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:
            parse_remote_prefill(body.kv_transfer_params)  # client input: a 400 naming the field
        except ValueError as error:
            raise InputError("kv_transfer_params", str(error)) from error
        try:
            prefill_leg = is_prefill_leg(body.kv_transfer_params, bool(body.stream))
        except ValueError as error:
            raise InputError("stream", str(error)) from error
        if prefill_leg:
            fields = leg_sampling(fields)
        structured, structured_param = structured_outputs_from(body.response_format, body.structured_outputs)
        if forced_tools is not None:
            if structured is not None:
                raise InputError(
                    "tool_choice", "a forced tool call constrains the answer: response_format cannot constrain it too"
                )
            structured, structured_param = forced_tools, "tools"
        params = SamplingParams(**fields, structured_outputs=structured)
        try:
            self.processor.check_params(params)
        except SamplingParamsError as error:
            if error.param.startswith("structured_outputs") and structured_param != "structured_outputs":
                raise InputError(structured_param, str(error).split(": ", 1)[-1]) from error
            raise
        if prefill_leg and structured is not None:
            # Checked, but the prefill leg samples nothing anyone reads: its decode applies the grammar.
            params = dataclasses.replace(params, structured_outputs=None)
        elif structured is not None:
            self.metrics.structured_requests.labels(structured.kind).inc()
        if params.n > MAX_N:
            raise InputError("n", f"n must be at most {MAX_N}")
        if params.n > 1 and body.kv_transfer_params:
            raise InputError("n", "kv_transfer_params needs n=1 (one request's KV is handed over)")
        return params

    # ----- streaming ----------------------------------------------------------------------------

    async def _stream_completion(
        self, request: web.Request, body: CompletionRequest, request_id: str, children: Children, params: SamplingParams
    ) -> web.StreamResponse:
        response = await start_sse(request, _leg_headers(request))
        results = [ChoiceResult() for _ in children]
        created = int(time.time())
        # aclosing: if the client goes away mid-stream, the choices' cleanup (abort) runs right here.
        async with aclosing(
            self.choices.stream(request_id, children, params, body.kv_transfer_params, body.cache_salt, results)
        ) as deltas:
            try:
                async for delta in deltas:
                    logprobs = (
                        self.logprobs.completion(list(delta.logprobs), delta.token_ids)
                        if body.logprobs is not None
                        else None
                    )
                    chunk = CompletionResponse(
                        id=request_id,
                        created=created,
                        model=self.model_name,
                        choices=[CompletionChoice(delta.index, delta.text, logprobs, delta.finish_reason)],
                    )
                    await response.write(sse_event(chunk))
            except ProtocolError as error:
                return await end_stream_with_error(response, error)
        await _write_report(request, response, children, results)
        if body.stream_options and body.stream_options.include_usage:
            await response.write(
                sse_event(
                    CompletionResponse(
                        id=request_id,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=usage(children, results),
                    )
                )
            )
        await response.write(SSE_DONE)
        return response

    async def _stream_chat(
        self,
        request: web.Request,
        body: ChatCompletionRequest,
        request_id: str,
        children: Children,
        params: SamplingParams,
        readers: list[ChatOutputReader | None],
    ) -> web.StreamResponse:
        response = await start_sse(request, _leg_headers(request))
        results = [ChoiceResult() for _ in children]
        created = int(time.time())
        reader_of = {index: reader for (_, index), reader in zip(children, readers, strict=True)}

        def chunk(choices: list[ChatChunkChoice], chunk_usage: Usage | None = None) -> bytes:
            return sse_event(
                ChatCompletionChunk(
                    id=request_id, created=created, model=self.model_name, choices=choices, usage=chunk_usage
                )
            )

        for _, index in children:
            await response.write(chunk([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))]))
        async with aclosing(
            self.choices.stream(request_id, children, params, body.kv_transfer_params, body.cache_salt, results)
        ) as deltas:
            try:
                async for delta in deltas:
                    logprobs = self.logprobs.chat(delta.logprobs) if body.logprobs else None
                    reader = reader_of[delta.index]
                    finish_reason = delta.finish_reason
                    if reader is None:
                        message = ChatDelta(content=delta.text or None)
                    else:
                        if finish_reason is None:
                            piece = reader.feed(delta.text)
                        else:
                            piece = reader.feed_last(delta.text)
                            finish_reason = reader.finish_reason(finish_reason)
                        message = ChatDelta(
                            content=piece.content or None,
                            reasoning_content=piece.reasoning or None,
                            tool_calls=piece.calls or None,
                        )
                    await response.write(chunk([ChatChunkChoice(delta.index, message, logprobs, finish_reason)]))
            except ProtocolError as error:
                return await end_stream_with_error(response, error)
        await _write_report(request, response, children, results)
        if body.stream_options and body.stream_options.include_usage:
            await response.write(chunk([], usage(children, results)))
        await response.write(SSE_DONE)
        return response
