"""The engine's API process: OpenAI-compatible HTTP (aiohttp) in front of an EngineCore process.

Requests are validated by decoding into pdserve.api.protocol types and converting to
SamplingParams; anything wrong is a 4xx OpenAI-style error, never a crash. Each choice of a
request is one core request ("<id>-<prompt>-<choice>"); outputs stream back through the core
client's queues and the incremental detokenizer. Whatever way a handler ends (finished, client
gone, error), core requests still running are aborted, so their blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from pdserve.api.protocol import (
    SSE_DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ProtocolError,
    TopLogprob,
    Usage,
    decode_request,
    openapi_document,
    sse_event,
)
from pdserve.api.tokenizer import apply_chat_template, encode_prompt
from pdserve.engine.core_client import EngineCoreClient, EngineDeadError, RequestRejectedError
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.metrics import EngineMetrics
from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError
from pdserve.kvtransfer.params import parse_remote_prefill, wants_remote_decode

logger = logging.getLogger(__name__)

MAX_N = 16
MAX_LOGPROBS = 20
MAX_BODY_BYTES = 4 << 20
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens")


@dataclass
class ChoiceResult:
    """What one choice produced so far (streamed as deltas, or gathered)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    first_token_time: float | None = None


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None


@dataclass
class ServerLimits:
    """Bounds that keep an overloaded or stopping server answering (every one a clear error)."""

    # Core requests (choices) in flight beyond which new requests get 503 + Retry-After: the
    # engine's waiting queue stays bounded, and a router can send the request elsewhere.
    max_in_flight: int = 4096
    request_timeout: float | None = None  # seconds for a whole request; None: unbounded
    retry_after: int = 1  # seconds, in 503 answers


class EngineServer:
    def __init__(self, client: EngineCoreClient, tokenizer: Any, model_name: str, eos_token_ids: list[int],
                 api_key: str | None = None, limits: ServerLimits | None = None) -> None:
        self.client = client
        self.api_key = api_key
        self.limits = limits or ServerLimits()
        self.draining = False  # set on shutdown: new requests are refused, running ones finish
        self.metrics = EngineMetrics(lambda: client.stats, {
            "block_size": str(client.ready.block_size), "num_gpu_blocks": str(client.ready.num_kv_blocks),
            "enable_prefix_caching": "True"})
        client.on_stats = self.metrics.observe_stats
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = client.ready.max_model_len
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos_ids = eos_token_ids[1:]
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_as_json, self._check_api_key])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.render_metrics)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/debug/cached_blocks", self.debug_cached_blocks)
        return app

    async def debug_cached_blocks(self, request: web.Request) -> web.Response:
        """Every hash in the prefix cache (hex), for checking what routers believe against the truth."""
        hashes = await self.client.cached_blocks()
        return web.json_response({"block_size": self.client.ready.block_size,
                                  "block_hashes": [block_hash.hex() for block_hash in hashes]})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(f"pdserve engine ({self.model_name})", "v1"))

    @web.middleware
    async def _check_api_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With an API key set, /v1 and /debug need ``Authorization: Bearer <key>``; /health and /metrics stay
        open."""
        if (self.api_key is not None and request.path.startswith(("/v1/", "/debug/"))
                and request.headers.get("Authorization", "") != f"Bearer {self.api_key}"):
            raise ProtocolError("invalid or missing API key", status=401, error_type="authentication_error")
        return await handler(request)

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    # ----- simple endpoints -------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)
        return _json(ModelList(data=[card]))

    async def health(self, request: web.Request) -> web.Response:
        if not self.client.alive:
            return web.json_response({"status": "engine core is not running"}, status=503)
        if self.draining:
            return web.json_response({"status": "shutting down"}, status=503)
        # Routers learn here where this engine publishes its KV-cache events (pdserve/api/kv_events.py).
        return web.json_response({"status": "ok", "kv_events_port": self.client.ready.kv_events_port})

    def _admit(self, num_choices: int) -> None:
        """Refuse new work while draining or when the engine already has too much in flight."""
        if self.draining:
            raise ProtocolError("the server is shutting down; retry on another replica", 503,
                                error_type="service_unavailable", retry_after=self.limits.retry_after)
        if self.client.num_in_flight + num_choices > self.limits.max_in_flight:
            raise ProtocolError(f"the server is overloaded ({self.client.num_in_flight} requests in flight); "
                                "retry later", 503, error_type="service_unavailable",
                                retry_after=self.limits.retry_after)

    # ----- generation endpoints ---------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_request(await request.read(), CompletionRequest)
        async with self._releasing_refused(body):
            return await self._completions(request, body)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_request(await request.read(), ChatCompletionRequest)
        async with self._releasing_refused(body):
            return await self._chat_completions(request, body)

    @contextlib.asynccontextmanager
    async def _releasing_refused(self, body: Any) -> AsyncIterator[None]:
        """A decode request refused here (bad value, overload, shutdown) never reaches the scheduler,
        whose connector would otherwise tell the prefill engine to free the request's blocks: say it
        here, or they stay held until the lease ends."""
        try:
            yield
        except ProtocolError:
            params = body.kv_transfer_params
            if params and params.get("do_remote_prefill") is True and self.client.alive:
                await self.client.release_remote_blocks(params)
            raise

    async def _completions(self, request: web.Request, body: CompletionRequest) -> web.StreamResponse:
        self._check_model(body.model)
        prompts = self._completion_prompts(body.prompt)
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
        echo = bool(body.echo)
        params = self._sampling_params(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs,
                                       prompt_logprobs=body.logprobs if echo and body.logprobs is not None else None)
        for prompt in prompts:
            self._check_length(prompt, params.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        children = [(prompt, index * params.n + k) for index, prompt in enumerate(prompts) for k in range(params.n)]
        self._admit(len(children))
        if body.stream:
            return await self._stream_completion(request, body, request_id, children, params)
        results = await self._gather(request_id, children, params, body.kv_transfer_params, body.cache_salt)
        choices = []
        for (prompt, index), result in zip(children, results, strict=True):
            text = result.text
            logprobs = None
            if body.logprobs is not None:
                entries = result.logprobs
                if echo:
                    entries = [None, *(result.prompt_logprobs or [])] + entries
                logprobs = self._completion_logprobs(entries, prompt + result.token_ids if echo else result.token_ids)
            if echo:
                text = self.tokenizer.decode(prompt) + text
            choices.append(CompletionChoice(index, text, logprobs, result.finish_reason, result.stop_reason))
        response = CompletionResponse(id=request_id, created=int(time.time()), model=self.model_name, choices=choices,
                                      usage=self._usage(children, results),
                                      kv_transfer_params=results[0].kv_transfer_params)
        return _json(response)

    async def _chat_completions(self, request: web.Request, body: ChatCompletionRequest) -> web.StreamResponse:
        self._check_model(body.model)
        if not body.messages:
            raise ProtocolError("messages must not be empty", param="messages")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = apply_chat_template(self.tokenizer, messages, body.add_generation_prompt is not False,
                                         body.chat_template_kwargs)
        except ValueError as error:
            raise ProtocolError(str(error), param="messages") from error
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, logprobs)
        self._check_length(prompt, params.max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        children = [(prompt, k) for k in range(params.n)]
        self._admit(len(children))
        if body.stream:
            return await self._stream_chat(request, body, request_id, children, params)
        results = await self._gather(request_id, children, params, body.kv_transfer_params, body.cache_salt)
        choices = [ChatChoice(index, ChatResponseMessage(content=result.text),
                              self._chat_logprobs(result.logprobs) if body.logprobs else None,
                              result.finish_reason, result.stop_reason)
                   for (_, index), result in zip(children, results, strict=True)]
        return _json(ChatCompletionResponse(id=request_id, created=int(time.time()), model=self.model_name,
                                            choices=choices, usage=self._usage(children, results),
                                            kv_transfer_params=results[0].kv_transfer_params))

    # ----- validation -------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ProtocolError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                status=404, param="model", error_type="not_found_error")

    def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [encode_prompt(self.tokenizer, prompt)]
        elif all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [encode_prompt(self.tokenizer, p) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        vocab_size = len(self.tokenizer)
        for ids in prompts:
            if not ids:
                raise ProtocolError("a prompt is empty", param="prompt")
            if any(not 0 <= t < vocab_size for t in ids):
                raise ProtocolError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return prompts

    def _sampling_params(self, body: Any, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        fields = {name: getattr(body, name) for name in _SAMPLING_FIELDS if getattr(body, name) is not None}
        if self._is_prefill_leg(body):
            # The prefill leg computes the prompt's KV and samples one token. It must end by length
            # whatever that token is, so its blocks are always handed over to the decode engine.
            for name in ("stop", "stop_token_ids", "min_tokens"):
                fields.pop(name, None)
            fields["ignore_eos"] = True
            max_tokens = 1
        try:
            params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                    **fields)
        except SamplingParamsError as error:
            raise ProtocolError(str(error), param=error.param) from error
        if params.n > MAX_N:
            raise ProtocolError(f"n must be at most {MAX_N}", param="n")
        if params.n > 1 and body.kv_transfer_params:
            raise ProtocolError("kv_transfer_params needs n=1 (one request's KV is handed over)", param="n")
        if self.extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + self.extra_eos_ids)
        return params

    @staticmethod
    def _is_prefill_leg(body: Any) -> bool:
        """Checks kv_transfer_params (client input) and says whether this is a P/D prefill leg."""
        params = body.kv_transfer_params
        try:
            parse_remote_prefill(params)
        except ValueError as error:
            raise ProtocolError(str(error), param="kv_transfer_params") from error
        if not wants_remote_decode(params):
            return False
        if body.stream:
            raise ProtocolError("a prefill leg (kv_transfer_params.do_remote_decode) needs stream=false: its "
                                "answer carries the transfer parameters", param="stream")
        return True

    def _check_length(self, prompt: list[int], max_tokens: int | None) -> None:
        if len(prompt) >= self.max_model_len:
            raise ProtocolError(f"the prompt has {len(prompt)} tokens, but the context length is "
                                f"{self.max_model_len}", param="prompt")
        if max_tokens is not None and len(prompt) + max_tokens > self.max_model_len:
            raise ProtocolError(f"max_tokens ({max_tokens}) plus the prompt's {len(prompt)} tokens exceed the "
                                f"context length {self.max_model_len}", param="max_tokens")

    # ----- running choices --------------------------------------------------------------

    async def _run_choice(self, child_id: str, prompt: list[int], params: SamplingParams,
                          kv_transfer_params: dict[str, Any] | None, cache_salt: str | None,
                          result: ChoiceResult) -> AsyncIterator[ChoiceDelta | None]:
        """Run one choice, updating ``result`` and yielding what it produced at each output."""
        arrival = time.monotonic()
        queue = await self.client.add_request(child_id, prompt, params, self.eos_token_id, kv_transfer_params,
                                              cache_salt)
        detokenizer = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, prompt, params.stop,
                                             params.skip_special_tokens, params.include_stop_str_in_output)
        timeout = self.limits.request_timeout
        deadline = None if timeout is None else arrival + timeout
        while result.finish_reason is None:
            try:
                output = await asyncio.wait_for(queue.get(), None if deadline is None else deadline - time.monotonic())
            except TimeoutError:
                raise ProtocolError(f"the request did not finish within {timeout:g} s", 504,
                                    error_type="timeout") from None
            if isinstance(output, RequestRejectedError):
                raise ProtocolError(str(output)) from output
            if isinstance(output, Exception):
                raise output
            if result.first_token_time is None:
                result.first_token_time = time.monotonic()
            text = detokenizer.add_tokens(output.new_token_ids)
            result.token_ids.extend(output.new_token_ids)
            new_logprobs = output.new_logprobs or []
            result.logprobs.extend(new_logprobs)
            if output.prompt_logprobs is not None:
                result.prompt_logprobs = output.prompt_logprobs
            if detokenizer.stop_string is not None:
                await self.client.abort([child_id])
                result.finish_reason, result.stop_reason = "stop", detokenizer.stop_string
                result.num_cached_tokens = output.num_cached_tokens
            elif output.finish_reason == "error":
                result.finish_reason = "error"
                self.metrics.observe("error", arrival, result.first_token_time, time.monotonic(), len(result.token_ids))
                raise ProtocolError(f"the request failed: {output.stop_reason}", status=503,
                                    error_type="service_unavailable")
            elif output.finish_reason is not None:
                text += detokenizer.finish()
                result.finish_reason, result.stop_reason = output.finish_reason, output.stop_reason
                result.num_cached_tokens = output.num_cached_tokens
                result.kv_transfer_params = output.kv_transfer_params
            result.text += text
            if result.finish_reason is not None:
                self.metrics.observe(result.finish_reason, arrival, result.first_token_time, time.monotonic(),
                                     len(result.token_ids))
            yield ChoiceDelta(0, text, output.new_token_ids, new_logprobs, result.finish_reason)

    def _child_params(self, params: SamplingParams, choice: int) -> SamplingParams:
        if params.n > 1 and params.seed is not None:
            # Each choice its own seed, wrapped to stay a signed 64-bit integer.
            return dataclasses.replace(params, seed=(params.seed + choice + (1 << 63)) % (1 << 64) - (1 << 63))
        return params

    async def _choices(self, request_id: str, children: list[tuple[list[int], int]], params: SamplingParams,
                       kv_transfer_params: dict[str, Any] | None, cache_salt: str | None,
                       results: list[ChoiceResult]) -> AsyncIterator[ChoiceDelta]:
        """Run every choice concurrently, yielding their deltas as they come; aborts what is still
        running if the consumer stops early (client gone) or anything fails."""
        merged: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()
        child_ids = [f"{request_id}-{index}" for _, index in children]

        async def run(position: int) -> None:
            prompt, index = children[position]
            try:
                async for delta in self._run_choice(child_ids[position], prompt,
                                                    self._child_params(params, index % params.n),
                                                    kv_transfer_params, cache_salt, results[position]):
                    delta.index = index
                    merged.put_nowait(delta)
                merged.put_nowait(None)
            except BaseException as error:
                merged.put_nowait(error)

        tasks = [asyncio.create_task(run(position)) for position in range(len(children))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            unfinished = [cid for cid, result in zip(child_ids, results, strict=True) if result.finish_reason is None]
            if unfinished:
                self.metrics.requests.labels("abort").inc(len(unfinished))
                if self.client.alive:
                    await self.client.abort(unfinished)

    async def _gather(self, request_id: str, children: list[tuple[list[int], int]], params: SamplingParams,
                      kv_transfer_params: dict[str, Any] | None, cache_salt: str | None) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in children]
        async with aclosing(self._choices(request_id, children, params, kv_transfer_params, cache_salt,
                                          results)) as deltas:
            async for _ in deltas:
                pass
        return results

    # ----- streaming --------------------------------------------------------------------

    async def _stream_completion(self, request: web.Request, body: CompletionRequest, request_id: str,
                                 children: list[tuple[list[int], int]], params: SamplingParams) -> web.StreamResponse:
        response = await _start_sse(request)
        results = [ChoiceResult() for _ in children]
        created = int(time.time())
        # aclosing: if the client goes away mid-stream, the choices' cleanup (abort) runs right here.
        async with aclosing(self._choices(request_id, children, params, body.kv_transfer_params, body.cache_salt,
                                          results)) as deltas:
            try:
                async for delta in deltas:
                    logprobs = (self._completion_logprobs(delta.logprobs, delta.token_ids)
                                if body.logprobs is not None else None)
                    chunk = CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[
                        CompletionChoice(delta.index, delta.text, logprobs, delta.finish_reason)])
                    await response.write(sse_event(chunk))
            except ProtocolError as error:
                return await _end_stream_with_error(response, error)
        if body.stream_options and body.stream_options.include_usage:
            await response.write(sse_event(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                                              choices=[], usage=self._usage(children, results))))
        await response.write(SSE_DONE)
        return response

    async def _stream_chat(self, request: web.Request, body: ChatCompletionRequest, request_id: str,
                           children: list[tuple[list[int], int]], params: SamplingParams) -> web.StreamResponse:
        response = await _start_sse(request)
        results = [ChoiceResult() for _ in children]
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
            return sse_event(ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                                 choices=choices, usage=usage))

        for _, index in children:
            await response.write(chunk([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))]))
        async with aclosing(self._choices(request_id, children, params, body.kv_transfer_params, body.cache_salt,
                                          results)) as deltas:
            try:
                async for delta in deltas:
                    logprobs = self._chat_logprobs(delta.logprobs) if body.logprobs else None
                    await response.write(chunk([ChatChunkChoice(delta.index, ChatDelta(content=delta.text or None),
                                                                logprobs, delta.finish_reason)]))
            except ProtocolError as error:
                return await _end_stream_with_error(response, error)
        if body.stream_options and body.stream_options.include_usage:
            await response.write(chunk([], self._usage(children, results)))
        await response.write(SSE_DONE)
        return response

    # ----- response pieces --------------------------------------------------------------

    @staticmethod
    def _usage(children: list[tuple[list[int], int]], results: list[ChoiceResult]) -> Usage:
        # Each prompt counts once however many choices it has (choices share the prompt's list).
        prompt_tokens = sum(len(prompt) for prompt in {id(prompt): prompt for prompt, _ in children}.values())
        completion_tokens = sum(len(r.token_ids) for r in results)
        return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                     PromptTokensDetails(cached_tokens=results[0].num_cached_tokens))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, entries: list[TokenLogprobs | None], token_ids: list[int]) -> CompletionLogprobs:
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self._token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
            else:
                token_logprobs.append(entry.logprob)
                top.append({self._token_text(t): lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs,
                                                                     strict=True)})
        return CompletionLogprobs(tokens, token_logprobs, top, offsets)

    def _chat_logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for entry in entries:
            text = self._token_text(entry.token_id)
            content.append(ChatTokenLogprob(text, entry.logprob, [
                TopLogprob(self._token_text(t), lp, list(self._token_text(t).encode()))
                for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)], list(text.encode())))
        return ChatLogprobs(content)


async def _start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def _end_stream_with_error(response: web.StreamResponse, error: ProtocolError) -> web.StreamResponse:
    """Headers are gone already: the error travels as an event of the stream (as vLLM sends it)."""
    await response.write(sse_event(error.to_response()))
    await response.write(SSE_DONE)
    return response


def _json(payload: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(payload), status=status, content_type="application/json")


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure becomes an OpenAI-style error JSON with the right status."""
    try:
        return await handler(request)
    except ProtocolError as error:
        response = _json(error.to_response(), status=error.status)
        response.headers.update(error.headers)
        return response
    except EngineDeadError as error:
        return _json(ProtocolError(str(error), 503, error_type="service_unavailable").to_response(), status=503)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _json(ProtocolError(error.reason or "error", error.status,
                                   error_type="invalid_request_error").to_response(), status=error.status)
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client went away: nobody to answer
    except Exception as error:
        logger.exception("request %s %s failed", request.method, request.path)
        return _json(ProtocolError(f"internal error: {type(error).__name__}", 500,
                                   error_type="internal_server_error").to_response(), status=500)


@dataclass
class RunningServer:
    """A started engine server: its URL, and how to stop it."""

    url: str
    server: EngineServer
    runner: web.AppRunner

    async def drain(self, timeout: float) -> bool:
        """Stop taking new requests (503, /health fails) and wait, at most ``timeout`` seconds, until
        the running ones have finished and no blocks are held for a remote decode (a prefill keeps
        serving pulls for what it holds). True when everything drained in time."""
        self.server.draining = True
        client = self.server.client
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and client.alive:
            stats = client.stats
            if client.num_in_flight == 0 and (stats is None or stats.num_blocks_held_for_remote == 0):
                return True
            await asyncio.sleep(0.1)
        return not client.alive

    async def close(self) -> None:
        await self.runner.cleanup()  # stops accepting, closes connections (their handlers abort)
        await self.server.client.shutdown()


async def start_engine_server(args: Any, host: str = "127.0.0.1", port: int = 0,
                              served_model_name: str | None = None, api_key: str | None = None,
                              limits: ServerLimits | None = None) -> RunningServer:
    """Start the core process and the HTTP server; ``port`` 0 picks a free port."""
    from pathlib import Path

    from pdserve.api.tokenizer import load_tokenizer
    from pdserve.models.config import ModelConfig

    folder = args.resolved_model()
    client = await EngineCoreClient.start(args)
    try:
        tokenizer = load_tokenizer(args.tokenizer or folder)
        eos_ids = ModelConfig.from_folder(folder).eos_token_ids or (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        server = EngineServer(client, tokenizer, served_model_name or Path(folder).name, eos_ids, api_key, limits)
        # handler_cancellation: a client that leaves while its request waits (queued, or for remote
        # KV) cancels the handler at once, whose cleanup aborts the request and frees its blocks.
        runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await client.shutdown()
        raise
    bound_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://{host}:{bound_port}"
    logger.info("serving %s at %s/v1 (KV cache: %d blocks of %d tokens, context %d)", server.model_name, url,
                client.ready.num_kv_blocks, client.ready.block_size, client.ready.max_model_len)
    return RunningServer(url, server, runner)
