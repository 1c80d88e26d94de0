"""Serving completions and chat completions: each HTTP request becomes one core request per choice
("<id>-<choice>"); their outputs stream back through the core client's queues and the incremental
detokenizer, gathered into one answer or streamed as SSE events.

Whatever way a handler ends (finished, client gone, error), the core requests still running are
aborted, so their blocks are freed. A P/D decode leg refused at the door (bad value, overload,
draining) tells its prefill engine to free the blocks it holds for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.api.http import json_response
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
    decode_request,
    sse_event,
)
from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.params import parse_remote_prefill
from pdserve.kvtransfer.prefill_side import is_prefill_leg, prefill_leg_sampling
from pdserve.server.core_client import EngineCoreClient, RequestRejectedError
from pdserve.server.detokenizer import IncrementalDetokenizer
from pdserve.server.input_processor import InputError, InputProcessor
from pdserve.server.metrics import EngineMetrics
from pdserve.server.responses import (
    Children,
    ChoiceDelta,
    ChoiceResult,
    LogprobFormatter,
    end_stream_with_error,
    start_sse,
    usage,
)

MAX_N = 16
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
    ) -> None:
        self.client = client
        self.processor = processor
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits
        self.logprobs = LogprobFormatter(processor.tokenizer)
        self.draining = False  # set on shutdown: new requests are refused, running ones finish

    # ----- endpoints ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_request(await request.read(), CompletionRequest)
        async with self._releasing_refused(body.kv_transfer_params):
            return await self._completions(request, body)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_request(await request.read(), ChatCompletionRequest)
        async with self._releasing_refused(body.kv_transfer_params):
            return await self._chat_completions(request, body)

    @contextlib.asynccontextmanager
    async def _releasing_refused(self, kv_transfer_params: dict[str, Any] | None) -> AsyncIterator[None]:
        """A decode request refused here never reaches the scheduler, whose connector would
        otherwise tell the prefill engine to free the request's blocks: say it here, or they stay
        held until the lease ends."""
        try:
            yield
        except (ProtocolError, ValueError):
            if kv_transfer_params and kv_transfer_params.get("do_remote_prefill") is True and self.client.alive:
                await self.client.release_remote_blocks(kv_transfer_params)
            raise

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
                entries: list[TokenLogprobs | None] = list(result.logprobs)
                if echo:
                    entries = [None, *(result.prompt_logprobs or []), *entries]
                logprobs = self.logprobs.completion(entries, prompt + result.token_ids if echo else result.token_ids)
            if echo:
                text = self.processor.tokenizer.decode(prompt) + text
            choices.append(CompletionChoice(index, text, logprobs, result.finish_reason, result.stop_reason))
        return json_response(
            CompletionResponse(
                id=request_id,
                created=int(time.time()),
                model=self.model_name,
                choices=choices,
                usage=usage(children, results),
                kv_transfer_params=results[0].kv_transfer_params,
            )
        )

    async def _chat_completions(self, request: web.Request, body: ChatCompletionRequest) -> web.StreamResponse:
        self._check_model(body.model)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= self.processor.max_logprobs:
            raise InputError("top_logprobs", f"top_logprobs must be between 0 and {self.processor.max_logprobs}")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = self.processor.chat_prompt(
            messages, body.add_generation_prompt is not False, body.chat_template_kwargs
        ).token_ids
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, logprobs)
        self.processor.check_max_tokens(prompt, params.max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        children = [(prompt, k) for k in range(params.n)]
        self._admit(len(children))
        if body.stream:
            return await self._stream_chat(request, body, request_id, children, params)
        results = await self._gather(request_id, children, params, body.kv_transfer_params, body.cache_salt)
        choices = [
            ChatChoice(
                index,
                ChatResponseMessage(content=result.text),
                self.logprobs.chat(result.logprobs) if body.logprobs else None,
                result.finish_reason,
                result.stop_reason,
            )
            for (_, index), result in zip(children, results, strict=True)
        ]
        return json_response(
            ChatCompletionResponse(
                id=request_id,
                created=int(time.time()),
                model=self.model_name,
                choices=choices,
                usage=usage(children, results),
                kv_transfer_params=results[0].kv_transfer_params,
            )
        )

    # ----- admission and validation -------------------------------------------------------------

    def _admit(self, num_choices: int) -> None:
        """Refuse new work while draining or when the engine already has too much in flight."""
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
        self, body: Any, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
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
            fields = prefill_leg_sampling(fields)
        params = SamplingParams(**fields)
        self.processor.check_params(params)
        if params.n > MAX_N:
            raise InputError("n", f"n must be at most {MAX_N}")
        if params.n > 1 and body.kv_transfer_params:
            raise InputError("n", "kv_transfer_params needs n=1 (one request's KV is handed over)")
        return params

    # ----- running choices ----------------------------------------------------------------------

    async def _run_choice(
        self,
        child_id: str,
        prompt: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None,
        cache_salt: str | None,
        result: ChoiceResult,
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Run one choice, updating ``result`` and yielding what it produced at each output."""
        arrival = time.monotonic()
        queue = await self.client.add_request(
            child_id, prompt, params, self.processor.eos_token_id, kv_transfer_params, cache_salt
        )
        detokenizer = IncrementalDetokenizer(
            self.processor.tokenizer.backend_tokenizer,
            prompt,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )
        timeout = self.limits.request_timeout
        deadline = None if timeout is None else arrival + timeout
        while result.finish_reason is None:
            try:
                output = await asyncio.wait_for(queue.get(), None if deadline is None else deadline - time.monotonic())
            except TimeoutError:
                raise ProtocolError(
                    f"the request did not finish within {timeout:g} s", 504, error_type="timeout"
                ) from None
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
                raise ProtocolError(
                    f"the request failed: {output.stop_reason}", status=503, error_type="service_unavailable"
                )
            elif output.finish_reason is not None:
                text += detokenizer.finish()
                result.finish_reason, result.stop_reason = output.finish_reason, output.stop_reason
                result.num_cached_tokens = output.num_cached_tokens
                result.kv_transfer_params = output.kv_transfer_params
            result.text += text
            if result.finish_reason is not None:
                self.metrics.observe(
                    result.finish_reason, arrival, result.first_token_time, time.monotonic(), len(result.token_ids)
                )
            yield ChoiceDelta(0, text, output.new_token_ids, new_logprobs, result.finish_reason)

    async def _choices(
        self,
        request_id: str,
        children: Children,
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None,
        cache_salt: str | None,
        results: list[ChoiceResult],
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Run every choice concurrently, yielding their deltas as they come; aborts what is still
        running if the consumer stops early (client gone) or anything fails."""
        merged: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()
        child_ids = [f"{request_id}-{index}" for _, index in children]
        per_choice = self.processor.choice_params(params)

        async def run(position: int) -> None:
            prompt, index = children[position]
            try:
                async for delta in self._run_choice(
                    child_ids[position],
                    prompt,
                    per_choice[index % params.n],
                    kv_transfer_params,
                    cache_salt,
                    results[position],
                ):
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

    async def _gather(
        self,
        request_id: str,
        children: Children,
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in children]
        async with aclosing(
            self._choices(request_id, children, params, kv_transfer_params, cache_salt, results)
        ) as deltas:
            async for _ in deltas:
                pass
        return results

    # ----- streaming ----------------------------------------------------------------------------

    async def _stream_completion(
        self, request: web.Request, body: CompletionRequest, request_id: str, children: Children, params: SamplingParams
    ) -> web.StreamResponse:
        response = await start_sse(request)
        results = [ChoiceResult() for _ in children]
        created = int(time.time())
        # aclosing: if the client goes away mid-stream, the choices' cleanup (abort) runs right here.
        async with aclosing(
            self._choices(request_id, children, params, body.kv_transfer_params, body.cache_salt, results)
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
    ) -> web.StreamResponse:
        response = await start_sse(request)
        results = [ChoiceResult() for _ in children]
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], chunk_usage: Usage | None = None) -> bytes:
            return sse_event(
                ChatCompletionChunk(
                    id=request_id, created=created, model=self.model_name, choices=choices, usage=chunk_usage
                )
            )

        for _, index in children:
            await response.write(chunk([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))]))
        async with aclosing(
            self._choices(request_id, children, params, body.kv_transfer_params, body.cache_salt, results)
        ) as deltas:
            try:
                async for delta in deltas:
                    logprobs = self.logprobs.chat(delta.logprobs) if body.logprobs else None
                    await response.write(
                        chunk(
                            [
                                ChatChunkChoice(
                                    delta.index, ChatDelta(content=delta.text or None), logprobs, delta.finish_reason
                                )
                            ]
                        )
                    )
            except ProtocolError as error:
                return await end_stream_with_error(response, error)
        if body.stream_options and body.stream_options.include_usage:
            await response.write(chunk([], usage(children, results)))
        await response.write(SSE_DONE)
        return response
