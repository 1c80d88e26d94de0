"""Serving completions and chat completions: each request is checked (model, admission, prompts,
sampling), run as one core request per choice (``choices.ChoiceRunner``), and answered as one JSON
response or streamed as SSE events. What its ``kv_transfer_params`` may make this engine do is the P/D
gate's to decide (``pd_gate.PDGate``): the request comes from it with its ``PDLeg``, which goes to the core
with each choice.

For the router, a stream may carry each data event's token ids in a comment before it (asked for with
``TOKENS_HEADER``), and a continued stream (``PDLeg.continued``) answers under the broken stream's ``id`` and
``created``, without a role chunk, its output so far fed to the chat parsers but not sent
(pdserve/api/continuation.py).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.api.auth import RouterVerifier
from pdserve.api.chat import ConversationError, conversation
from pdserve.api.continuation import (
    CONTINUED_HEADER,
    HANDOFF_COMMENT,
    TOKENS_HEADER,
    Continuation,
    StreamTokens,
    tokens_comment,
)
from pdserve.api.http import json_response
from pdserve.api.prefill_leg import leg_sampling
from pdserve.api.protocol import (
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
    sse_event,
)
from pdserve.api.report import REPORT_HEADER, comment, header_value
from pdserve.api.tenancy import AHEAD_HEADER, TENANT_HEADER, request_cache_salt
from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from pdserve.server.chat_output import ChatOutputReader, ChatParsers
from pdserve.server.choices import ChoiceRunner
from pdserve.server.core_client import EngineCoreClient
from pdserve.server.gateway_prefill import GatewayPrefill
from pdserve.server.input_processor import InputError, InputProcessor, structured_outputs_from
from pdserve.server.metrics import EngineMetrics
from pdserve.server.pd_gate import PDGate, PDLeg, leg_headers
from pdserve.server.responses import (
    Children,
    ChoiceDelta,
    ChoiceResult,
    LogprobFormatter,
    end_stream_with_error,
    report,
    start_sse,
    usage,
)
from pdserve.server.tool_parsers import call_ids
from pdserve.server.tools import tool_use

MAX_N = 16


def _answer_headers(request: web.Request, children: Children, results: list[ChoiceResult]) -> dict[str, str] | None:
    """A JSON answer's headers: the leg's, and the request report when the router asked for it."""
    headers = leg_headers(request)
    if request.headers.get(REPORT_HEADER) == "1":
        headers = {**(headers or {}), REPORT_HEADER: header_value(report(children, results))}
    return headers


async def _write_report(
    request: web.Request, response: web.StreamResponse, children: Children, results: list[ChoiceResult]
) -> None:
    """A stream's report comment, when the router asked for it (before the usage event and [DONE])."""
    if request.headers.get(REPORT_HEADER) == "1":
        await response.write(comment(report(children, results)))


def _continued_ids(continued: Continuation | None, prefix: str) -> tuple[str, int]:
    """A response's ``id`` and ``created``: a continued stream's own, else new ones."""
    if continued is not None:
        return continued.id, continued.created
    return f"{prefix}-{uuid.uuid4().hex}", int(time.time())


def _check_continued(continued: Continuation | None, children: Children) -> None:
    """A continuation names choices of this request (one it does not name had produced nothing)."""
    if continued is not None and not {c.index for c in continued.choices} <= {i for _, i in children}:
        raise InputError("kv_transfer_params", "kv_transfer_params.continue names a choice this request does not have")


def _stream_headers(request: web.Request, leg: PDLeg) -> dict[str, str] | None:
    headers = leg_headers(request)
    return {**(headers or {}), CONTINUED_HEADER: "1"} if leg.continued is not None else headers


class _HandedOff(Exception):
    """The server drains: the router continues this stream elsewhere from the tokens it was sent."""


class _EventWriter:
    """Writes a stream's data events, each after its token comment when the router asked for them (such a
    stream is handed back to the router once the draining server says so: ``_HandedOff``)."""

    def __init__(self, request: web.Request, response: web.StreamResponse, serving: OpenAIServing) -> None:
        self.response = response
        self.serving = serving
        self.with_tokens = request.headers.get(TOKENS_HEADER) == "1"

    async def write(self, event: bytes, delta: ChoiceDelta) -> None:
        if self.with_tokens:
            tokens = StreamTokens(delta.index, delta.token_ids, delta.finish_reason, delta.stop_reason, delta.seed)
            event = tokens_comment(tokens) + event  # one write: the router never sees one without the other
        await self.response.write(event)
        if self.with_tokens and self.serving.handing_off and delta.finish_reason is None:
            raise _HandedOff()


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
        self.handing_off = False  # set later in a drain: streams the router relays are handed back to it
        self.gate = PDGate(client, metrics, kv_transfer, serves_blocks, router_verifier)
        # Behind a gateway a decode engine sends its request's prefill leg itself (the P/D decode role only).
        self.gateway_prefill = GatewayPrefill(metrics, router_verifier) if kv_transfer and not serves_blocks else None
        self.chat_parsers = chat_parsers or ChatParsers()

    # ----- endpoints ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw, own_params = await self._prefill_first(request, chat=False)
        body, leg = await self.gate.open(request, raw, CompletionRequest, own_params)
        async with self.gate.releasing_refused(request):
            return await self._completions(request, body, leg)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw, own_params = await self._prefill_first(request, chat=True)
        body, leg = await self.gate.open(request, raw, ChatCompletionRequest, own_params)
        async with self.gate.releasing_refused(request):
            return await self._chat_completions(request, body, leg)

    async def _prefill_first(self, request: web.Request, chat: bool) -> tuple[bytes, bool]:
        """The request's body, with the params of the prefill leg this engine sent itself when a gateway's picker
        named a prefill pod (then True)."""
        raw = await request.read()
        if self.gateway_prefill is None:
            return raw, False
        return await self.gateway_prefill.run(request, raw, chat)

    async def _completions(self, request: web.Request, body: CompletionRequest, leg: PDLeg) -> web.StreamResponse:
        self._check_model(body.model)
        self._priority(body)  # a bad one is refused before anything is computed or held
        prompts = [prompt.token_ids for prompt in self.processor.prompts(body.prompt)]
        echo = bool(body.echo)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = self._sampling_params(
            body,
            leg,
            max_tokens,
            body.logprobs,
            prompt_logprobs=body.logprobs if echo and body.logprobs is not None else None,
        )
        for prompt in prompts:
            self.processor.check_max_tokens(prompt, params.max_tokens)
        if len(prompts) > 1 and leg.remote_decode:
            # One prefill leg hands one prompt's blocks to one decode engine; the others would stay
            # held, unnamed, until their leases ended.
            raise InputError("prompt", "a prefill leg (kv_transfer_params.do_remote_decode) takes one prompt")
        children = [(prompt, index * params.n + k) for index, prompt in enumerate(prompts) for k in range(params.n)]
        _check_continued(leg.continued, children)
        request_id, created = _continued_ids(leg.continued, "cmpl")
        self._admit(len(children), "n" if params.n > 1 else "prompt", leg.continued is not None)
        leg = await self.gate.screen(request, leg, prompts, params.prompt_logprobs is not None)
        if body.stream:
            return await self._stream_completion(request, body, leg, request_id, created, children, params)
        results = await self.choices.gather(
            request_id, children, params, leg, _cache_salt(request, body), self._priority(body), _ahead(request)
        )
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
                created=created,
                model=self.model_name,
                choices=choices,
                usage=usage(children, results),
                kv_transfer_params=results[0].kv_transfer_params,
            ),
        )

    async def _chat_completions(
        self, request: web.Request, body: ChatCompletionRequest, leg: PDLeg
    ) -> web.StreamResponse:
        self._check_model(body.model)
        self._priority(body)  # a bad one is refused before anything is computed or held
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
        params = self._sampling_params(body, leg, max_tokens, logprobs, forced_tools=tools.constraint)
        self.processor.check_max_tokens(
            prompt,
            params.max_tokens,
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        )
        children = [(prompt, k) for k in range(params.n)]
        _check_continued(leg.continued, children)
        request_id, created = _continued_ids(leg.continued, "chatcmpl")
        self._admit(len(children), "n", leg.continued is not None)
        leg = await self.gate.screen(request, leg, [prompt], params.prompt_logprobs is not None)
        readers = [self.chat_parsers.reader(prompt, tools, call_ids(request_id, index)) for _, index in children]
        if body.stream:
            return await self._stream_chat(request, body, leg, request_id, created, children, params, readers)
        results = await self.choices.gather(
            request_id, children, params, leg, _cache_salt(request, body), self._priority(body), _ahead(request)
        )
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
                created=created,
                model=self.model_name,
                choices=choices,
                usage=usage(children, results),
                kv_transfer_params=results[0].kv_transfer_params,
            ),
        )

    # ----- admission and validation -------------------------------------------------------------

    def _admit(self, num_choices: int, param: str, continued: bool = False) -> None:
        """Refuse new work while draining or when the engine already has too much in flight; a request
        more than an idle engine would take is the client's to change (400 naming ``param``). A continued
        stream is not new work: it was admitted once, and is never refused for load."""
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
        if not continued and self.client.num_in_flight + num_choices > self.limits.max_in_flight:
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

    def _priority(self, body: CompletionRequest | ChatCompletionRequest) -> int:
        """The request's priority (lower first); as in vLLM, one other than 0 is an error on an engine that
        schedules first come, first served, which would ignore it."""
        if not body.priority:
            return 0
        if self.client.ready.scheduling_policy != "priority":
            raise InputError(
                "priority", "this engine schedules first come, first served: it takes priority 0 (or none) only"
            )
        return body.priority

    def _sampling_params(
        self,
        body: Any,
        leg: PDLeg,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        forced_tools: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """``forced_tools``: the grammar of a forced tool call (tool_choice "required" or named)."""
        fields = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
        fields.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if leg.remote_decode:
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
        if leg.remote_decode and structured is not None:
            # Checked, but the prefill leg samples nothing anyone reads: its decode applies the grammar.
            params = dataclasses.replace(params, structured_outputs=None)
        elif structured is not None:
            self.metrics.structured_requests.labels(structured.kind).inc()
        if params.n > MAX_N:
            raise InputError("n", f"n must be at most {MAX_N}")
        return params

    # ----- streaming ----------------------------------------------------------------------------

    async def _stream_completion(
        self,
        request: web.Request,
        body: CompletionRequest,
        leg: PDLeg,
        request_id: str,
        created: int,
        children: Children,
        params: SamplingParams,
    ) -> web.StreamResponse:
        response = await start_sse(request, _stream_headers(request, leg))
        events = _EventWriter(request, response, self)
        results = [ChoiceResult() for _ in children]
        # aclosing: if the client goes away mid-stream, the choices' cleanup (abort) runs right here.
        async with aclosing(
            self.choices.stream(
                request_id,
                children,
                params,
                leg,
                _cache_salt(request, body),
                results,
                leg.continued,
                events.with_tokens,
                self._priority(body),
                _ahead(request),
            )
        ) as deltas:
            try:
                async for delta in deltas:
                    if delta.replayed:
                        continue
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
                    await events.write(sse_event(chunk), delta)
            except ProtocolError as error:
                return await end_stream_with_error(response, error)
            except _HandedOff:
                self.metrics.streams_handed_off.inc()
                await response.write(HANDOFF_COMMENT)
                return response  # leaving the block aborts its requests: their KV is freed
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
        leg: PDLeg,
        request_id: str,
        created: int,
        children: Children,
        params: SamplingParams,
        readers: list[ChatOutputReader | None],
    ) -> web.StreamResponse:
        response = await start_sse(request, _stream_headers(request, leg))
        events = _EventWriter(request, response, self)
        results = [ChoiceResult() for _ in children]
        reader_of = {index: reader for (_, index), reader in zip(children, readers, strict=True)}

        def chunk(choices: list[ChatChunkChoice], chunk_usage: Usage | None = None) -> bytes:
            return sse_event(
                ChatCompletionChunk(
                    id=request_id, created=created, model=self.model_name, choices=choices, usage=chunk_usage
                )
            )

        if leg.continued is None:  # a continued stream's client had them from the first engine
            for _, index in children:
                await response.write(chunk([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))]))
        async with aclosing(
            self.choices.stream(
                request_id,
                children,
                params,
                leg,
                _cache_salt(request, body),
                results,
                leg.continued,
                events.with_tokens,
                self._priority(body),
                _ahead(request),
            )
        ) as deltas:
            try:
                async for delta in deltas:
                    reader = reader_of[delta.index]
                    if delta.replayed:
                        if reader is not None:
                            reader.feed(delta.text)  # where the first engine's parsers stood
                        continue
                    logprobs = self.logprobs.chat(delta.logprobs) if body.logprobs else None
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
                    await events.write(chunk([ChatChunkChoice(delta.index, message, logprobs, finish_reason)]), delta)
            except ProtocolError as error:
                return await end_stream_with_error(response, error)
            except _HandedOff:
                self.metrics.streams_handed_off.inc()
                await response.write(HANDOFF_COMMENT)
                return response  # leaving the block aborts its requests: their KV is freed
        await _write_report(request, response, children, results)
        if body.stream_options and body.stream_options.include_usage:
            await response.write(chunk([], usage(children, results)))
        await response.write(SSE_DONE)
        return response


def _ahead(request: web.Request) -> bool:
    """Whether the router's flow control put the request ahead of the others of its priority (``AHEAD_HEADER``)."""
    return request.headers.get(AHEAD_HEADER) == "1"


def _cache_salt(request: web.Request, body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The salt of the request's block hashes: its tenant's (named by the router, else the API key it presents) and
    its own cache_salt."""
    headers = request.headers
    return request_cache_salt(headers.get("Authorization"), body.cache_salt, headers.get(TENANT_HEADER))
