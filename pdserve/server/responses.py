"""Response building for the engine's OpenAI API: what a choice produced so far, and its usage,
logprobs and streamed events in OpenAI's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.api.protocol import (
    SSE_DONE,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    ProtocolError,
    TopLogprob,
    Usage,
    sse_event,
)
from pdserve.api.report import Report
from pdserve.engine.outputs import TokenLogprobs

# (prompt token ids, choice index) of each core request one HTTP request runs.
Children = list[tuple[list[int], int]]


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
    # time.monotonic() when the choice reached the engine, produced its first token, and finished.
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # The text of a continued stream's output so far, decoded again: for parsers to read, never to send.
    replayed: bool = False
    seed: int | None = None  # on a sampled choice's first delta: the seed its draws come from


def usage(children: Children, results: list[ChoiceResult]) -> Usage:
    # Each prompt counts once however many choices it has (choices share the prompt's list).
    prompt_tokens = sum(len(prompt) for prompt in {id(prompt): prompt for prompt, _ in children}.values())
    completion_tokens = sum(len(r.token_ids) for r in results)
    return Usage(
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
        PromptTokensDetails(cached_tokens=results[0].num_cached_tokens),
    )


def report(children: Children, results: list[ChoiceResult]) -> Report:
    """What the router asked to be told of a finished request (pdserve/api/report.py)."""
    counts = usage(children, results)
    found = Report(counts.prompt_tokens, counts.completion_tokens)
    if len(results) == 1:
        result = results[0]
        if result.arrival_time is not None and result.first_token_time is not None:
            found.ttft_s = result.first_token_time - result.arrival_time
            if result.finish_time is not None and len(result.token_ids) > 1:
                found.tpot_s = (result.finish_time - result.first_token_time) / (len(result.token_ids) - 1)
    return found


class LogprobFormatter:
    """Logprob entries as the completions and chat APIs show them (token texts, not ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def completion(self, entries: list[TokenLogprobs | None], token_ids: list[int]) -> CompletionLogprobs:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = 0
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
            else:
                token_logprobs.append(entry.logprob)
                top.append(
                    {self.token_text(t): lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)}
                )
        return CompletionLogprobs(tokens, token_logprobs, top, offsets)

    def chat(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for entry in entries:
            text = self.token_text(entry.token_id)
            content.append(
                ChatTokenLogprob(
                    text,
                    entry.logprob,
                    [
                        TopLogprob(self.token_text(t), lp, list(self.token_text(t).encode()))
                        for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
                    ],
                    list(text.encode()),
                )
            )
        return ChatLogprobs(content)


async def start_sse(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **(headers or {})}
    )
    await response.prepare(request)
    return response


async def end_stream_with_error(response: web.StreamResponse, error: ProtocolError) -> web.StreamResponse:
    """Headers are gone already: the error travels as an event of the stream (as vLLM sends it)."""
    await response.write(sse_event(error.to_response()))
    await response.write(SSE_DONE)
    return response
