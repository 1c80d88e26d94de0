"""Running one HTTP request's choices: each choice is one core request ("<id>-<choice>"), run
concurrently; their outputs come back through the core client's queues and the incremental
detokenizer, as deltas to stream or gathered into results. Whatever way a consumer stops
(finished, client gone, error), the core requests still running are aborted, so their blocks are
freed; the request timeout ends a choice with 504.

A continued stream (``kv_transfer_params.continue``) gives each choice its output so far: an ended
choice only counts; an unfinished one runs with it as output already generated, and its text is
decoded again first (one ``replayed`` delta) so that the detokenizer's held-back tail, stop strings
and the consumer's parsers stand where the first engine's stood.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from pdserve.api.continuation import Continuation, ContinuedChoice
from pdserve.api.protocol import ProtocolError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.server.core_client import EngineCoreClient, RequestRejectedError
from pdserve.server.detokenizer import IncrementalDetokenizer
from pdserve.server.input_processor import InputProcessor
from pdserve.server.metrics import EngineMetrics
from pdserve.server.pd_gate import PDLeg
from pdserve.server.responses import Children, ChoiceDelta, ChoiceResult


class ChoiceRunner:
    def __init__(
        self, client: EngineCoreClient, processor: InputProcessor, metrics: EngineMetrics, request_timeout: float | None
    ) -> None:
        self.client = client
        self.processor = processor
        self.metrics = metrics
        self.request_timeout = request_timeout

    async def _run_one(
        self,
        child_id: str,
        prompt: list[int],
        params: SamplingParams,
        leg: PDLeg,
        cache_salt: str | None,
        result: ChoiceResult,
        continued: ContinuedChoice | None = None,
        priority: int = 0,
        ahead: bool = False,
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Run one choice, updating ``result`` and yielding what it produced at each output; ``continued``:
        its output so far on another engine."""
        arrival = result.arrival_time = time.monotonic()
        detokenizer = IncrementalDetokenizer(
            self.processor.tokenizer.backend_tokenizer,
            prompt,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )
        old_token_ids: list[int] = []
        if continued is not None:
            old_token_ids = continued.token_ids
            result.token_ids.extend(old_token_ids)
            result.text = detokenizer.add_tokens(old_token_ids)
            if continued.finish_reason is not None:  # it ended before the stream broke: it only counts
                result.text += detokenizer.finish()
                result.finish_reason, result.stop_reason = continued.finish_reason, continued.stop_reason
                return
            if detokenizer.stop_string is not None:
                raise ProtocolError(
                    "kv_transfer_params.continue: a choice's output already ends at a stop string",
                    param="kv_transfer_params",
                )
        queue = await self.client.add_request(
            child_id,
            prompt,
            params,
            self.processor.eos_token_id,
            cache_salt,
            leg.remote_prefill,
            leg.remote_decode,
            leg.peer,
            old_token_ids,
            priority,
            ahead,
        )
        if old_token_ids:
            yield ChoiceDelta(0, result.text, [], [], None, replayed=True)
        seed = None if params.is_greedy else params.seed  # said once, with the first delta
        timeout = self.request_timeout
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
            # num_cached_tokens counts prompt tokens only: a continuation's cache hits may cover its output too.
            if detokenizer.stop_string is not None:
                await self.client.abort([child_id])
                result.finish_reason, result.stop_reason = "stop", detokenizer.stop_string
                result.num_cached_tokens = min(output.num_cached_tokens, len(prompt))
            elif output.finish_reason == "error":
                result.finish_reason = "error"
                self.metrics.observe(
                    "error", arrival, result.first_token_time, time.monotonic(), len(result.token_ids), len(prompt)
                )
                if output.error_status == 400:  # its input could not be served (a grammar that did not compile)
                    raise ProtocolError(str(output.stop_reason), status=400)
                raise ProtocolError(
                    f"the request failed: {output.stop_reason}", status=503, error_type="service_unavailable"
                )
            elif output.finish_reason is not None:
                text += detokenizer.finish()
                result.finish_reason, result.stop_reason = output.finish_reason, output.stop_reason
                result.num_cached_tokens = min(output.num_cached_tokens, len(prompt))
                result.kv_transfer_params = output.kv_transfer_params
            result.text += text
            if result.finish_reason is not None:
                if result.finish_reason == "length" and params.structured_outputs is not None:
                    self.metrics.structured_length_capped.inc()
                result.finish_time = time.monotonic()
                self.metrics.observe(
                    result.finish_reason,
                    arrival,
                    result.first_token_time,
                    result.finish_time,
                    len(result.token_ids),
                    len(prompt),
                )
            yield ChoiceDelta(
                0, text, output.new_token_ids, new_logprobs, result.finish_reason, result.stop_reason, seed=seed
            )
            seed = None

    async def stream(
        self,
        request_id: str,
        children: Children,
        params: SamplingParams,
        leg: PDLeg,
        cache_salt: str | None,
        results: list[ChoiceResult],
        continuation: Continuation | None = None,
        pick_seeds: bool = False,
        priority: int = 0,
        ahead: bool = False,
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """Run every choice concurrently, yielding their deltas as they come; aborts what is still
        running if the consumer stops early (client gone) or anything fails. ``continuation``: the
        choices' output so far on another engine (a choice it does not name had none), and the seed
        each drew from; ``pick_seeds``: a sampled choice without a seed gets one (said with its first
        delta), so that another engine could continue it drawing the same tokens."""
        merged: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()
        if continuation is not None:
            # Core ids of its own: the broken leg's (same response id) may have just ended here, their last outputs
            # still on their way to this process, which routes outputs by id.
            request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        child_ids = [f"{request_id}-{index}" for _, index in children]
        per_choice = self.processor.choice_params(params)

        async def run(position: int) -> None:
            prompt, index = children[position]
            continued = None if continuation is None else continuation.of(index)
            choice_params = per_choice[index % params.n]
            if continued is not None and continued.seed is not None:
                choice_params = dataclasses.replace(choice_params, seed=continued.seed)
            elif pick_seeds and choice_params.seed is None and not choice_params.is_greedy:
                choice_params = dataclasses.replace(choice_params, seed=secrets.randbits(63))
            try:
                async for delta in self._run_one(
                    child_ids[position],
                    prompt,
                    choice_params,
                    leg,
                    cache_salt,
                    results[position],
                    continued,
                    priority,
                    ahead,
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

    async def gather(
        self,
        request_id: str,
        children: Children,
        params: SamplingParams,
        leg: PDLeg,
        cache_salt: str | None,
        priority: int = 0,
        ahead: bool = False,
    ) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in children]
        stream = self.stream(request_id, children, params, leg, cache_salt, results, priority=priority, ahead=ahead)
        async with aclosing(stream) as deltas:
            async for _ in deltas:
                pass
        return results
