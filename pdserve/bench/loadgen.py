"""pdserve bench: an OpenAI-compatible load generator measuring what users feel.

Sends streaming ``/v1/completions`` requests (prompts as token ids, so input lengths are exact
whatever the server's tokenizer) at a Poisson or fixed rate, or as fast as a concurrency limit
allows, and reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), request and
token throughput, and goodput under TTFT/TPOT SLOs. Result keys follow ``vllm bench serve``.

Workloads: ``random`` (token ids drawn from a seeded generator, input/output lengths fixed or
uniform in a ±range), ``shared-prefix`` (K prefixes × N suffixes: what prefix-aware routing is
for), and ``chat`` (short multi-turn conversations through /v1/chat/completions).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm


@dataclass
class BenchRequest:
    prompt_token_ids: list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat
    output_len: int
    prompt_len: int


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class BenchConfig:
    base_url: str
    model: str
    num_prompts: int = 100
    request_rate: float = float("inf")
    arrival: str = "poisson"  # or "fixed"
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    workload: str = "random"
    prefix_len: int = 512
    num_prefixes: int = 4
    vocab_size: int = 1000
    ignore_eos: bool = False
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    seed: int = 0
    api_key: str | None = None
    progress: bool = True


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def make_workload(config: BenchConfig) -> list[BenchRequest]:
    rng = random.Random(config.seed)
    requests = []
    if config.workload == "random":
        for _ in range(config.num_prompts):
            length = _length(rng, config.input_len, config.range_ratio)
            requests.append(
                BenchRequest(
                    [rng.randrange(config.vocab_size) for _ in range(length)],
                    None,
                    _length(rng, config.output_len, config.range_ratio),
                    length,
                )
            )
    elif config.workload == "shared-prefix":
        prefixes = [
            [rng.randrange(config.vocab_size) for _ in range(config.prefix_len)] for _ in range(config.num_prefixes)
        ]
        for index in range(config.num_prompts):
            suffix_len = _length(rng, config.input_len, config.range_ratio)
            suffix = [rng.randrange(config.vocab_size) for _ in range(suffix_len)]
            prompt = prefixes[index % config.num_prefixes] + suffix
            requests.append(
                BenchRequest(prompt, None, _length(rng, config.output_len, config.range_ratio), len(prompt))
            )
        rng.shuffle(requests)
    elif config.workload == "chat":
        topics = ["the weather", "a recipe", "a trip", "a bug", "a book", "the news"]
        for _ in range(config.num_prompts):
            turns = rng.randint(1, 3)
            messages = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Tell me about {rng.choice(topics)} ({turn})."})
                if turn < turns - 1:
                    messages.append({"role": "assistant", "content": "Here is what I know."})
            requests.append(BenchRequest(None, messages, _length(rng, config.output_len, config.range_ratio), 0))
    else:
        raise ValueError(f"unknown workload {config.workload!r}: random, shared-prefix or chat")
    return requests


def arrival_offsets(count: int, rate: float, arrival: str, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start (all zero for an infinite rate)."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed + 1)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return offsets


async def _send(session: aiohttp.ClientSession, config: BenchConfig, request: BenchRequest) -> RequestResult:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if request.messages is not None:
        path = "/v1/chat/completions"
        body["messages"] = request.messages
    else:
        path = "/v1/completions"
        body["prompt"] = request.prompt_token_ids
    result = RequestResult(ok=False, prompt_len=request.prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(config.base_url.rstrip("/") + path, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                payload = json.loads(data)
                if payload.get("usage"):
                    result.output_tokens = payload["usage"]["completion_tokens"]
                    result.prompt_len = payload["usage"]["prompt_tokens"]
                choices = payload.get("choices") or []
                if not choices:
                    continue
                # A chunk is a token's arrival even when its text is empty: a token that ends inside a
                # character streams as an empty delta, and its text comes with a later one.
                if "role" in (choices[0].get("delta") or {}):
                    continue  # the chat role announcement carries no token
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (TimeoutError, aiohttp.ClientError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


def _percentiles(values: list[float], name: str) -> dict[str, float]:
    if not values:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p90_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {
        f"mean_{name}_ms": statistics.fmean(values) * 1e3,
        f"median_{name}_ms": statistics.median(values) * 1e3,
        f"p90_{name}_ms": pick(0.90),
        f"p99_{name}_ms": pick(0.99),
    }


def summarise(config: BenchConfig, results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    good = [
        r
        for r in done
        if (config.slo_ttft_ms is None or r.ttft * 1e3 <= config.slo_ttft_ms)
        and (
            config.slo_tpot_ms is None
            or r.output_tokens <= 1
            or (r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 <= config.slo_tpot_ms
        )
    ]
    summary: dict[str, Any] = {
        "model_id": config.model,
        "workload": config.workload,
        "num_prompts": config.num_prompts,
        "request_rate": config.request_rate if config.request_rate != float("inf") else "inf",
        "max_concurrency": config.max_concurrency,
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "request_goodput": len(good) / duration if duration else 0.0,
        "goodput": len(good) / duration if duration else 0.0,
        "slo_ttft_ms": config.slo_ttft_ms,
        "slo_tpot_ms": config.slo_tpot_ms,
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }
    summary.update(_percentiles([r.ttft for r in done], "ttft"))
    summary.update(_percentiles(tpots, "tpot"))
    summary.update(_percentiles([gap for r in done for gap in r.itl], "itl"))
    summary.update(_percentiles([r.e2e for r in done], "e2el"))
    # Per-request values (completed requests, in workload order), for distributions and plots.
    summary["ttfts_ms"] = [r.ttft * 1e3 for r in done]
    summary["tpots_ms"] = [
        (r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 if r.output_tokens > 1 else None for r in done
    ]
    return summary


async def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    requests = make_workload(config)
    offsets = arrival_offsets(len(requests), config.request_rate, config.arrival, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = tqdm(total=len(requests), disable=not config.progress, desc="requests")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                result = await _send(session, config, request)
            else:
                async with limit:
                    result = await _send(session, config, request)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
    bar.close()
    return summarise(config, list(results), duration)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"{'Successful requests:':<36}{summary['completed']:>12}",
        f"{'Failed requests:':<36}{summary['failed']:>12}",
        f"{'Benchmark duration (s):':<36}{summary['duration']:>12.2f}",
        f"{'Request throughput (req/s):':<36}{summary['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<36}{summary['output_throughput']:>12.2f}",
        f"{'Goodput (req/s):':<36}{summary['goodput']:>12.2f}",
    ]
    for name, title in (
        ("ttft", "Time to first token"),
        ("tpot", "Time per output token"),
        ("itl", "Inter-token latency"),
        ("e2el", "End-to-end latency"),
    ):
        lines.append(
            f"{title} (ms): mean {summary[f'mean_{name}_ms']:.2f}, median {summary[f'median_{name}_ms']:.2f},"
            f" p90 {summary[f'p90_{name}_ms']:.2f}, p99 {summary[f'p99_{name}_ms']:.2f}"
        )
    return "\n".join(lines)
