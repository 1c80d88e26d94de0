"""Multi-turn chat on the P/D deployment, KV tiers and peer reads off and on: prompt tokens computed, cached, loaded,
and TTFT.

Also throughput, the KV bytes moved from prefill to decode, and whether the answers stay the same.

Setup: `pdserve serve` (router + 1 prefill + 1 decode engine; on 2 cores the launcher pins each engine to a core
of its own), fresh processes for each configuration, every address on 127.0.0.1. The engines' KV pools keep
their default size (2 GiB per engine on CPU; on GPU what --gpu-memory-utilization leaves) unless --kv-cache-memory
sets it: at the default size a full run takes about an hour per configuration on 2 cores (below).
Configurations (--configs, in one command, same seed, same workload):

- off: no tier, no peer reads (--kv-peer-hold-seconds 0);
- peer: peer reads alone (the defaults: the decode engine holds each answered turn for the next turn's prefill);
- disk: --kv-tier-disk on a fresh temporary folder, in which `pdserve serve` gives each engine a folder of its
  own (as each pod has its own disk); no peer reads;
- shared: --kv-tier-shared on a fresh temporary folder (both engines, as a ReadWriteMany volume would be); no peer
  reads;
- all: disk + shared + peer reads, and --kv-tier-host-bytes (--host-bytes) when CUDA is available (the host tier
  is GPU only).

A configuration that does not start (e.g. a tier flag `pdserve serve` does not accept yet) or fails during its
run is reported with the reason, and the next one runs.

Models (--model): demo, the built-in demo model (a tiny Qwen3, ChatML template, 4096 positions); bench, the ~85M
Llama of bench/pd_vs_colocated.py built with max_position_embeddings 8192 (RoPE stores no weight, so the
weights are those of the other benches). The bench model's vocabulary is the demo tokenizer's (1024 tokens), so it
takes the demo model's tokenizer files and chat template (chat_template.jinja) as they are.

Workload: S sessions of up to T turns (--turns, default 4). Each turn appends 300-1500 tokens of new user text
(--min-new-tokens, --max-new-tokens: random words of the tokenizer's vocabulary, tokens that decode to a space
and at least two letters, so N words are N tokens; seeded) and asks, through the router's /v1/chat/completions,
streamed, for a 24-token answer (--answer-tokens; temperature 0, ignore_eos, logprobs for the answers' tokens).
The next turn's messages are the history (the user turns, and the answers as returned) plus the new text. A
session ends early when its next prompt might not fit the model's context (max_model_len from the router's
/v1/models). Requests go out in round-robin order over the sessions, turn by turn (all first turns, then all
second turns...), at most --concurrency (3) in flight; a turn waits for the session's previous answer. S is
derived from the pools: sessions are drawn until the workload's distinct KV (the sum over sessions of their final
prompt lengths, estimated with 24-token answers) reaches --oversubscription (3.5) times the engines' combined pool
(num_gpu_blocks x block_size of both engines, from vllm:cache_config_info on their /metrics), so a session's
blocks have left the pools by the time it comes back. --sessions N fixes S instead. One short warm-up request
comes before the counters are read.

Figures per configuration (every counter the difference over the workload, warm-up excluded), from the engines'
own /metrics (their URLs read from the command lines of `pdserve serve`'s children) and the router's:
- pdserve_prefix_cache_queries_total, pdserve_prefix_cache_hits_total: prompt tokens looked up in and served
  from the pool, each engine; the (no-tier) pool hit rate is hits / queries;
- pdserve_kv_tier_hit_tokens_total{medium}, pdserve_kv_tier_loaded_bytes_total,
  pdserve_kv_tier_stored_bytes_total: tokens and bytes loaded from, and bytes stored into, the tiers (each name's
  series summed over labels and engines, hits also by medium). Read when present, else 0 and "not exposed";
- pdserve_kv_transfer_bytes_total (decode engine): KV bytes pulled from the prefill engine (P/D transfer);
- pdserve_preemptions_total; vllm:cache_config_info{block_size, num_gpu_blocks}: the pool sizes;
- pdserve_router_requests_total{path} (router): disagg, decode_only (the router skips the prefill leg when the
  decode engine lacks fewer than its --pd-min-prefill-tokens, 256, of the prompt: the decode engine computes
  it), fallback.
Prompt tokens computed: by the prefill engine, its queries - pool hits - tier hit tokens; by the decode engine,
the same less what it pulled (pulled bytes / the model's KV bytes per token: whole blocks, so approximate). Client
side: prompt tokens sent (the streams' usage), TTFT p50/p90 of turns >= 2 (time to the first chunk carrying a
token), output tokens/s and requests/s over the whole workload, and how many answers (text and token texts)
equal the `off` run's.

Answer blocks matched: each turn's prompt is rendered here (the model's tokenizer and chat template, as the
engines render it; the streams' prompt_tokens check the length), and turn N's leading full blocks are compared
with turn N-1's prompt + answer as generated. The share is over the full blocks of that sequence that hold answer
tokens: a re-rendered answer whose tokens differ from the generated ones cannot reuse them. The generated ids come
from the logprobs' token texts; byte tokens all show as U+FFFD there, so those are read from the answer's text
(``generated_ids``).

How long: --smoke (2 sessions x 2 turns of 260-400 new tokens: above the router's 256, so turns take the P/D
path) about 30-50 s per configuration on 2 cores. Full size was not run yet: demo ~1090 sessions, ~4000
requests (3.7M distinct tokens over two 0.5M-token pools); bench ~55 sessions (0.2M over two 29K-token pools);
`off` computes about 2.5x the distinct tokens, so from the smoke's prefill speeds (demo some thousands of tokens/s
per core, bench ~350) about an hour per configuration for either model. The tier folders grow to about the
distinct KV (~15 GiB for either model on CPU: the pools are 2 GiB each) unless a tier's size bound is lower.

Prints a table per configuration; with --plot DIR writes DIR/multiturn-<model>.png (TTFT p50/p90 and prompt
tokens computed per configuration). Last line JSON {"bench": "multiturn", "model": ..., "configs": {name: {...}}}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pd_vs_colocated import build_model
from plots import add_plot_argument, pyplot, save

from pdserve.api.tokenizer import apply_chat_template, load_tokenizer
from pdserve.launcher import free_port
from pdserve.models.config import ModelConfig
from pdserve.models.dtype import resolve_dtype
from pdserve.testing.metrics import metric, scrape
from pdserve.testing.processes import Process, server_env

CONFIGS = ("off", "peer", "disk", "shared", "all")
PATHS = ("disagg", "decode_only", "fallback")
BENCH_MODEL_POSITIONS = 8192
TIER_HITS = "pdserve_kv_tier_hit_tokens_total"
TIER_LOADED = "pdserve_kv_tier_loaded_bytes_total"
TIER_STORED = "pdserve_kv_tier_stored_bytes_total"
TIER_METRICS = (TIER_HITS, TIER_LOADED, TIER_STORED)
# Tokens a turn may need beyond its text and the previous answer, for the estimate that keeps prompts in context.
RENDER_MARGIN = 8
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# ----- processes ------------------------------------------------------------------------------------------------


class ConfigFailed(RuntimeError):
    """A configuration that did not start, or did not finish its run: why."""


@dataclass
class Servers:
    router: str
    prefill: str
    decode: str


def children(pid: int) -> dict[int, list[str]]:
    """The direct children of ``pid`` with their command lines (from /proc: no dependency)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may hold spaces and parentheses: the parent pid follows the last ")".
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found


def engine_urls(launched: dict[int, list[str]]) -> dict[str, str]:
    """The engines among `pdserve serve`'s children, by role: their ports are on their command lines (the
    launcher picks them and prints none)."""
    urls = {}
    for argv in launched.values():
        if "pdserve.cli" in argv and "--port" in argv:
            role = argv[argv.index("pdserve.cli") + 1]
            if role in ("prefill", "decode"):
                urls[role] = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    return urls


def tier_flags(name: str, folder: Path, host_bytes: str | None) -> list[str]:
    """Configuration ``name``'s tier and peer-read flags, its tier folders made fresh under ``folder``."""
    flags = []
    for configs, flag, sub in (
        ({"disk", "all"}, "--kv-tier-disk", "disk"),
        ({"shared", "all"}, "--kv-tier-shared", "shared"),
    ):
        if name in configs:
            (folder / sub).mkdir()
            flags += [flag, str(folder / sub)]
    if name == "all" and host_bytes:
        flags += ["--kv-tier-host-bytes", host_bytes]
    if name not in ("peer", "all"):
        flags += ["--kv-peer-hold-seconds", "0"]
    return flags


def start_failure(process: Process) -> str:
    """Why ``process`` does not serve: its exit code if it exited, and the last lines of its output."""
    assert process.process is not None
    code = process.process.poll()
    lines = [line.strip() for line in process.log().splitlines() if line.strip()][-3:]
    state = f"exited with code {code}" if code is not None else "was not healthy in time"
    return f"did not start: pdserve serve {state}: {' | '.join(lines) or 'no output'}"


@contextlib.contextmanager
def deployment(name: str, model: str, folder: Path, scratch: Path, args: argparse.Namespace) -> Iterator[Servers]:
    """`pdserve serve` with configuration ``name``'s tiers while the block runs; stopped in every case (and an
    engine it left behind killed). ConfigFailed when it does not start."""
    config_dir = scratch / name
    config_dir.mkdir()
    port = free_port()
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(folder)]
    argv += ["--served-model-name", model, "--log-level", "warning", *tier_flags(name, config_dir, args.host_bytes)]
    if args.kv_cache_memory:
        argv += ["--kv-cache-memory", args.kv_cache_memory]
    process = Process(f"serve-{name}", argv, server_env(), port, config_dir / "serve.log")
    launched: dict[int, list[str]] = {}
    try:
        process.start()
        assert process.process is not None
        try:
            process.wait_healthy(args.start_timeout)
        except RuntimeError:
            raise ConfigFailed(start_failure(process)) from None
        launched = children(process.process.pid)
        urls = engine_urls(launched)
        if set(urls) != {"prefill", "decode"}:
            raise ConfigFailed(f"found engines {sorted(urls)} among pdserve serve's children, not prefill and decode")
        yield Servers(process.url, urls["prefill"], urls["decode"])
    finally:
        process.stop(60)
        for pid, child_argv in launched.items():  # the launcher stops its children, unless it had to be killed
            with contextlib.suppress(OSError):
                if (Path(f"/proc/{pid}") / "cmdline").read_bytes().decode(errors="replace").split("\0") == child_argv:
                    os.kill(pid, signal.SIGKILL)


@dataclass
class Served:
    """The model as this bench reads it: its served name and tokenizer, its KV bytes per token in the engines'
    dtype, and what maps an answer's token texts back to ids (``generated_ids``)."""

    name: str
    tokenizer: Any
    kv_bytes_per_token: int
    ids_of: dict[str, int] = field(init=False)  # token text -> id, for the texts only one token decodes to
    byte_ids: dict[int, int] = field(init=False)  # byte -> the id of its byte-level token
    special_ids: set[int] = field(init=False)  # tokens the answers' text leaves out

    def __post_init__(self) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        ids: dict[str, list[int]] = {}
        for token_id in range(len(self.tokenizer)):
            ids.setdefault(self.tokenizer.decode([token_id]), []).append(token_id)
        self.ids_of = {text: found[0] for text, found in ids.items() if len(found) == 1}
        self.byte_ids = {byte: self.tokenizer.convert_tokens_to_ids(char) for byte, char in bytes_to_unicode().items()}
        self.special_ids = set(self.tokenizer.all_special_ids)


# ----- workload -------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    sessions: list[list[str]]  # each session's new user text, turn by turn
    pools: dict[str, int]  # KV blocks per engine role
    block_size: int
    max_model_len: int
    estimated_tokens: int  # the sessions' final prompt lengths, summed, with answers of --answer-tokens tokens

    @property
    def pool_tokens(self) -> int:
        return sum(self.pools.values()) * self.block_size


def pool(url: str) -> tuple[int, int]:
    """An engine's KV pool, (blocks, block size), from vllm:cache_config_info."""
    for series in scrape(url):
        name, _, labels = series.partition("{")
        if name == "vllm:cache_config_info":
            values = dict(_LABEL.findall(labels))
            return int(values["num_gpu_blocks"]), int(values["block_size"])
    raise ConfigFailed(f"{url}/metrics has no vllm:cache_config_info")


def served_max_model_len(router: str) -> int:
    with urllib.request.urlopen(f"{router}/v1/models", timeout=10) as response:
        return int(json.loads(response.read())["data"][0]["max_model_len"])


def word_ids(tokenizer: Any) -> list[int]:
    """Tokens that decode to a space and two letters or more: N of them, decoded and joined, are N tokens again."""
    found = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if len(text) > 2 and text[0] == " " and text[1:].isalpha():
            found.append(token_id)
    return found


def conversation(texts: list[str], answers: list[str]) -> list[dict[str, str]]:
    """The messages of a session's turn: its user texts so far, each earlier one followed by its answer."""
    messages = []
    for index, text in enumerate(texts):
        if index:
            messages.append({"role": "assistant", "content": answers[index - 1]})
        messages.append({"role": "user", "content": text})
    return messages


def draw_sessions(
    tokenizer: Any, args: argparse.Namespace, target_tokens: int, context: int
) -> tuple[list[list[str]], int]:
    """The sessions' user texts (seeded): ``args.sessions`` of them, or as many as it takes for their estimated
    final prompt lengths to add up to ``target_tokens``; a session stops before a turn that might not fit
    ``context`` with its answer. Also the estimate's sum."""
    first = len(apply_chat_template(tokenizer, conversation([""], [])))
    later = len(apply_chat_template(tokenizer, conversation(["", ""], [""]))) - first  # an exchange's template
    if first + args.max_new_tokens + RENDER_MARGIN + args.answer_tokens > context:
        raise SystemExit(f"a first turn of {args.max_new_tokens} new tokens may not fit max_model_len {context}")
    words = word_ids(tokenizer)
    rng = random.Random(args.seed)
    sessions: list[list[str]] = []
    total = 0
    # Bounded: every session adds at least one turn of at least --min-new-tokens (> 0) tokens.
    while len(sessions) < args.sessions if args.sessions else total < target_tokens:
        texts: list[str] = []
        length = 0
        for turn in range(args.turns):
            count = rng.randint(args.min_new_tokens, args.max_new_tokens)
            grown = length + count + RENDER_MARGIN + (later + args.answer_tokens if turn else first)
            if grown + args.answer_tokens > context:
                break
            texts.append(tokenizer.decode(rng.choices(words, k=count)))
            length = grown
        sessions.append(texts)
        total += length
    return sessions, total


def make_workload(servers: Servers, tokenizer: Any, args: argparse.Namespace) -> Workload:
    """The workload sized on the running deployment's pools and context."""
    (prefill_blocks, block_size), (decode_blocks, decode_block_size) = pool(servers.prefill), pool(servers.decode)
    if block_size != decode_block_size:
        raise ConfigFailed(f"the engines' block sizes differ: {block_size} and {decode_block_size}")
    context = served_max_model_len(servers.router)
    target = int(args.oversubscription * (prefill_blocks + decode_blocks) * block_size)
    sessions, estimated = draw_sessions(tokenizer, args, target, context)
    return Workload(sessions, {"prefill": prefill_blocks, "decode": decode_blocks}, block_size, context, estimated)


# ----- client ---------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # the answer's token texts, from its logprobs
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


async def ask(
    http: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> Answer:
    """One streamed chat request: its answer, TTFT (to the first chunk carrying a token) and usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = Answer()
    start = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                answer.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return answer
            async for raw in response.content:  # ends with the stream
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    answer.error = f"error event: {str(chunk['error'])[:200]}"
                    return answer
                if chunk.get("usage"):
                    answer.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    answer.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    tokens = [entry["token"] for entry in (choice.get("logprobs") or {}).get("content") or []]
                    if tokens and answer.ttft_s is None:
                        answer.ttft_s = time.perf_counter() - start
                    answer.tokens += tokens
                    answer.text += choice["delta"].get("content") or ""
    except (TimeoutError, aiohttp.ClientError) as error:
        answer.error = f"{type(error).__name__}: {error}"
        return answer
    if len(answer.tokens) != max_tokens:
        answer.error = f"{len(answer.tokens)} tokens streamed, {max_tokens} asked"
    return answer


def answered(history: list[Answer | None]) -> list[Answer] | None:
    """A session's answers so far, when every one of them came (else its next turn is not sent)."""
    done = [answer for answer in history if answer is not None and answer.error is None]
    return done if len(done) == len(history) else None


async def run_workload(
    url: str, model: str, sessions: list[list[str]], args: argparse.Namespace
) -> tuple[list[list[Answer | None]], float]:
    """Every session's turns through the router, round-robin over the sessions turn by turn, --concurrency in
    flight: the answers (None where a turn was not sent: an earlier one failed) and the wall time."""
    answers: list[list[Answer | None]] = [[None] * len(texts) for texts in sessions]
    finished = [[asyncio.Event() for _ in texts] for texts in sessions]
    order = deque(
        (turn, index) for turn in range(args.turns) for index, texts in enumerate(sessions) if turn < len(texts)
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def worker() -> None:
            while order:
                turn, index = order.popleft()
                try:
                    if turn:  # sent by another worker earlier (the order is by turn): it ends
                        await finished[index][turn - 1].wait()
                    history = answered(answers[index][:turn])
                    if history is not None:
                        messages = conversation(sessions[index][: turn + 1], [answer.text for answer in history])
                        answers[index][turn] = await ask(http, url, model, messages, args.answer_tokens)
                finally:
                    finished[index][turn].set()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return answers, time.perf_counter() - start


async def warm_up(url: str, served: Served) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        text = served.tokenizer.decode(random.Random(-1).choices(word_ids(served.tokenizer), k=32))
        answer = await ask(http, url, served.name, conversation([text], []), 4)
    if answer.error is not None:
        raise ConfigFailed(f"the warm-up request failed: {answer.error}")


# ----- figures --------------------------------------------------------------------------------------------------


def counters(url: str) -> dict[str, float]:
    """An engine's counters this bench reads (0 when absent); each tier series summed by name, tier hits also per
    medium (key "pdserve_kv_tier_hit_tokens_total:MEDIUM")."""
    values = scrape(url)
    found = {
        "queries": metric(values, "pdserve_prefix_cache_queries_total"),
        "hits": metric(values, "pdserve_prefix_cache_hits_total"),
        "pulled_bytes": metric(values, "pdserve_kv_transfer_bytes_total"),
        "preemptions": metric(values, "pdserve_preemptions_total"),
    }
    for series, value in values.items():
        name, _, labels = series.partition("{")
        if name in TIER_METRICS:
            found[name] = found.get(name, 0.0) + value
            if name == TIER_HITS:
                key = f"{TIER_HITS}:{dict(_LABEL.findall(labels)).get('medium', '')}"
                found[key] = found.get(key, 0.0) + value
    return found


def router_paths(url: str) -> dict[str, float]:
    """How many requests the router sent each way: disagg (a prefill leg, then decode pulls its KV), decode_only
    (decode computes the prompt: the router skips the prefill leg below its --pd-min-prefill-tokens), fallback."""
    values = scrape(url)
    return {path: metric(values, "pdserve_router_requests_total", path=path) for path in PATHS}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 1]); 0 for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def leading_blocks(left: list[int], right: list[int], block_size: int) -> int:
    """How many leading full blocks of the two token sequences are equal."""
    count = 0
    while (count + 1) * block_size <= min(len(left), len(right)):
        span = slice(count * block_size, (count + 1) * block_size)
        if left[span] != right[span]:
            break
        count += 1
    return count


def generated_ids(answer: Answer, served: Served) -> list[int] | None:
    """The answer's token ids as generated, from its token texts and its text (None when they do not line up).
    Byte tokens all show as U+FFFD: a run of them is read from the answer's text, as the UTF-8 bytes of the
    characters it decoded to; when it did not decode (its bytes are not valid UTF-8: the text shows U+FFFD), its
    ids are -1, equal to no token: re-rendered, the run is U+FFFD's own bytes EF BF BD, which it was not."""
    ids: list[int] = []
    pending: list[int | None] = []  # a run's tokens: None for a byte token, the id of a special token
    cursor = 0
    for token in [*answer.tokens, None]:  # None: the end of the text
        token_id = None if token is None else served.ids_of.get(token)
        if token is not None and (token_id is None or token_id in served.special_ids):
            pending.append(token_id)
            continue
        end = len(answer.text) if token is None else answer.text.find(token, cursor)
        if end < 0 or (end > cursor and None not in pending):
            return None
        raw = answer.text[cursor:end].encode()
        decoded = "\ufffd" not in answer.text[cursor:end] and len(raw) == pending.count(None)
        bytes_left = iter(raw)
        for item in pending:
            ids.append(item if item is not None else served.byte_ids[next(bytes_left)] if decoded else -1)
        pending = []
        if token_id is not None:
            ids.append(token_id)
            cursor = end + len(token or "")
    return ids


def block_reuse(served: Served, workload: Workload, answers: list[list[Answer | None]]) -> dict[str, int]:
    """Each answered turn's prompt rendered here, against the length the engines reported and against the
    previous turn's prompt + answer as generated (see the module's docstring); an answer whose ids cannot be read
    (``generated_ids``) is left out, and counted."""
    block_size = workload.block_size
    found = dict.fromkeys(
        ("answer_blocks", "answer_blocks_matched", "history_blocks", "history_blocks_matched", "unresolved_answers"), 0
    )
    found |= {"prompt_token_mismatches": 0, "distinct_kv_tokens": 0}
    for texts, session in zip(workload.sessions, answers, strict=True):
        previous: list[int] | None = None  # the previous turn's prompt
        generated: list[int] | None = None  # and its answer's ids
        final = 0
        for turn, answer in enumerate(session):
            history = answered(session[:turn])
            if answer is None or answer.error is not None or history is None:
                break
            messages = conversation(texts[: turn + 1], [a.text for a in history])
            prompt = apply_chat_template(served.tokenizer, messages)
            final = len(prompt)
            found["prompt_token_mismatches"] += answer.prompt_tokens != len(prompt)
            if previous is not None and generated is None:
                found["unresolved_answers"] += 1
            elif previous is not None and generated is not None:
                sequence = previous + generated
                common = leading_blocks(prompt, sequence, block_size)
                full, first_answer_block = len(sequence) // block_size, len(previous) // block_size
                found["history_blocks"] += first_answer_block
                found["history_blocks_matched"] += min(common, first_answer_block)
                found["answer_blocks"] += full - first_answer_block
                found["answer_blocks_matched"] += max(0, common - first_answer_block)
            previous, generated = prompt, generated_ids(answer, served)
        found["distinct_kv_tokens"] += final
    return found


def measure(
    servers: Servers, workload: Workload, served: Served, args: argparse.Namespace
) -> tuple[dict[str, Any], list[list[Answer | None]]]:
    """Run the workload on a started deployment: its figures, and the answers."""
    engines = {"prefill": servers.prefill, "decode": servers.decode}
    pools = {role: pool(url)[0] for role, url in engines.items()}
    asyncio.run(warm_up(servers.router, served))
    before = {role: counters(url) for role, url in engines.items()}
    paths_before = router_paths(servers.router)
    answers, duration = asyncio.run(run_workload(servers.router, served.name, workload.sessions, args))
    after = {role: counters(url) for role, url in engines.items()}
    paths = delta(paths_before, router_paths(servers.router))
    engine = {role: delta(before[role], after[role]) for role in engines}
    sent = [answer for session in answers for answer in session if answer is not None]
    done = [answer for answer in sent if answer.error is None]
    later_ttfts = [
        answer.ttft_s
        for session in answers
        for answer in session[1:]
        if answer is not None and answer.error is None and answer.ttft_s is not None
    ]
    tier_hits = {role: engine[role].get(TIER_HITS, 0.0) for role in engines}
    by_medium: dict[str, float] = {}
    for values in engine.values():
        for key, value in values.items():
            if key.startswith(f"{TIER_HITS}:"):
                medium = key.partition(":")[2] or "?"
                by_medium[medium] = by_medium.get(medium, 0.0) + value
    computed = {role: engine[role]["queries"] - engine[role]["hits"] - tier_hits[role] for role in engines}
    pulled_tokens = engine["decode"]["pulled_bytes"] / served.kv_bytes_per_token
    computed["decode"] = max(0.0, computed["decode"] - pulled_tokens)
    figures: dict[str, Any] = {
        "pools_blocks": pools,
        "sessions": len(workload.sessions),
        "requests": len(sent),
        "failed": len(sent) - len(done),
        "not_sent": sum(len(texts) for texts in workload.sessions) - len(sent),
        "errors": sorted({answer.error for answer in sent if answer.error is not None})[:3],
        "router_paths": {path: int(count) for path, count in paths.items()},
        "duration_s": round(duration, 2),
        "prompt_tokens_sent": sum(answer.prompt_tokens for answer in done),
        "output_tokens": sum(answer.completion_tokens for answer in done),
        "prefill_queries": int(engine["prefill"]["queries"]),
        "prefill_pool_hits": int(engine["prefill"]["hits"]),
        "prefill_tier_hit_tokens": int(tier_hits["prefill"]),
        "prefill_computed_tokens": int(computed["prefill"]),
        "pool_hit_rate": round(engine["prefill"]["hits"] / max(engine["prefill"]["queries"], 1.0), 4),
        "decode_queries": int(engine["decode"]["queries"]),
        "decode_pool_hits": int(engine["decode"]["hits"]),
        "decode_tier_hit_tokens": int(tier_hits["decode"]),
        "decode_pulled_tokens": int(pulled_tokens),
        "decode_computed_tokens": int(computed["decode"]),
        "decode_pool_hit_rate": round(engine["decode"]["hits"] / max(engine["decode"]["queries"], 1.0), 4),
        "computed_tokens": int(computed["prefill"] + computed["decode"]),
        "tier_hit_tokens_by_medium": {medium: int(value) for medium, value in sorted(by_medium.items())},
        "tier_loaded_bytes": int(sum(values.get(TIER_LOADED, 0.0) for values in engine.values())),
        "tier_stored_bytes": int(sum(values.get(TIER_STORED, 0.0) for values in engine.values())),
        "tier_metrics_exposed": sorted({name for values in after.values() for name in TIER_METRICS if name in values}),
        "pd_transfer_bytes": int(engine["decode"]["pulled_bytes"]),
        "preemptions": int(engine["prefill"]["preemptions"] + engine["decode"]["preemptions"]),
        "ttft_p50_ms": round(statistics.median(later_ttfts) * 1e3, 1) if later_ttfts else 0.0,
        "ttft_p90_ms": round(percentile(later_ttfts, 0.9) * 1e3, 1),
        "output_tok_s": round(sum(answer.completion_tokens for answer in done) / duration, 2),
        "req_s": round(len(done) / duration, 3),
    }
    reuse = block_reuse(served, workload, answers)
    figures |= reuse
    figures["answer_block_share"] = round(reuse["answer_blocks_matched"] / max(reuse["answer_blocks"], 1), 4)
    return figures, answers


def same_answers(answers: list[list[Answer | None]], reference: list[list[Answer | None]]) -> tuple[int, int]:
    """How many turns got the same answer (text and tokens) in both runs, of all turns."""
    pairs = [pair for a, b in zip(answers, reference, strict=True) for pair in zip(a, b, strict=True)]
    same = sum(
        a is not None and b is not None and a.error is None and (a.text, a.tokens) == (b.text, b.tokens)
        for a, b in pairs
    )
    return same, len(pairs)


# ----- output ---------------------------------------------------------------------------------------------------


def mib(value: float) -> str:
    return f"{value / (1 << 20):.1f} MiB"


def print_config(name: str, figures: dict[str, Any]) -> None:
    print(f"\n== {name} ==")
    if "error" in figures:
        print(f"  {figures['error']}")
        return
    exposed = (
        "exposed: " + ", ".join(figures["tier_metrics_exposed"]) if figures["tier_metrics_exposed"] else "not exposed"
    )
    rows = [
        (
            "requests",
            f"{figures['requests']} ({figures['failed']} failed, {figures['not_sent']} not sent) in "
            f"{figures['duration_s']:.1f} s",
        ),
        (
            "KV pools",
            f"prefill {figures['pools_blocks']['prefill']} + decode {figures['pools_blocks']['decode']} blocks",
        ),
        ("router paths", " | ".join(f"{path} {count}" for path, count in figures["router_paths"].items())),
        (
            "prompt tokens",
            f"sent {figures['prompt_tokens_sent']} | computed {figures['computed_tokens']} "
            f"(prefill {figures['prefill_computed_tokens']} + decode ~{figures['decode_computed_tokens']})",
        ),
        (
            "prefill engine",
            f"queried {figures['prefill_queries']} | pool hits {figures['prefill_pool_hits']} "
            f"({figures['pool_hit_rate']:.1%}) | tier hits {figures['prefill_tier_hit_tokens']} | "
            f"computed {figures['prefill_computed_tokens']}",
        ),
        (
            "decode engine",
            f"queried {figures['decode_queries']} | pool hits {figures['decode_pool_hits']} "
            f"({figures['decode_pool_hit_rate']:.1%}) | tier hits {figures['decode_tier_hit_tokens']} | pulled "
            f"~{figures['decode_pulled_tokens']} | computed ~{figures['decode_computed_tokens']}",
        ),
        (
            "KV tiers",
            f"hits by medium {figures['tier_hit_tokens_by_medium'] or '-'} | loaded {mib(figures['tier_loaded_bytes'])}"
            f" | stored {mib(figures['tier_stored_bytes'])} | metrics {exposed}",
        ),
        ("P/D transfer", f"{mib(figures['pd_transfer_bytes'])} pulled by decode; {figures['preemptions']} preemptions"),
        ("TTFT turns >= 2", f"p50 {figures['ttft_p50_ms']:.0f} ms | p90 {figures['ttft_p90_ms']:.0f} ms"),
        ("throughput", f"{figures['output_tok_s']:.1f} output tok/s | {figures['req_s']:.2f} req/s"),
        ("answers as off's", figures["same_as_off"]),
        (
            "answer blocks matched",
            f"{figures['answer_blocks_matched']}/{figures['answer_blocks']} ({figures['answer_block_share']:.1%}); "
            f"history blocks {figures['history_blocks_matched']}/{figures['history_blocks']}; "
            f"{figures['unresolved_answers']} answers whose token ids could not be read left out",
        ),
        (
            "local rendering",
            f"{figures['prompt_token_mismatches']} prompts whose length differs from the engines'; distinct KV "
            f"{figures['distinct_kv_tokens']} tokens",
        ),
    ]
    for label, value in rows:
        print(f"  {label:<22} {value}")
    for error in figures["errors"]:
        print(f"  error: {error}")


def plot(model: str, results: dict[str, dict[str, Any]], folder: Path) -> None:
    ran = {name: figures for name, figures in results.items() if "error" not in figures}
    if not ran:
        print("plot: no configuration ran")
        return
    names = list(ran)
    figure, axes = pyplot().subplots(1, 2, figsize=(9, 3.5))
    width = 0.35
    for offset, key, label in ((-width / 2, "ttft_p50_ms", "p50"), (width / 2, "ttft_p90_ms", "p90")):
        axes[0].bar([i + offset for i in range(len(names))], [ran[n][key] for n in names], width, label=label)
    axes[0].set_xticks(range(len(names)), names)
    axes[0].set_ylabel("TTFT, turns >= 2 (ms)")
    axes[0].legend()
    axes[1].bar(names, [ran[n]["prefill_computed_tokens"] for n in names], color="tab:green", label="prefill engine")
    axes[1].bar(
        names,
        [ran[n]["decode_computed_tokens"] for n in names],
        bottom=[ran[n]["prefill_computed_tokens"] for n in names],
        color="tab:red",
        label="decode engine",
    )
    axes[1].set_ylabel("prompt tokens computed")
    axes[1].legend(fontsize=8)
    figure.suptitle(f"multi-turn chat, {model} model, KV tiers off and on (bench/multiturn.py)")
    save(figure, folder, f"multiturn-{model}")


# ----- main -----------------------------------------------------------------------------------------------------


def prepare_model(model: str, scratch: Path) -> Path:
    if model == "demo":
        from pdserve.models.demo import ensure_demo_model

        return ensure_demo_model()
    folder = scratch / "bench-model"
    build_model(folder, BENCH_MODEL_POSITIONS)
    return folder


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("demo", "bench"), default="demo")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--turns", type=int, default=4, help="turns per session at most")
    parser.add_argument("--min-new-tokens", type=int, default=300, help="new user tokens per turn, at least")
    parser.add_argument("--max-new-tokens", type=int, default=1500, help="new user tokens per turn, at most")
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=3, help="requests in flight at most")
    parser.add_argument(
        "--oversubscription", type=float, default=3.5, help="the workload's distinct KV over the engines' pools"
    )
    parser.add_argument("--sessions", type=int, default=None, help="this many sessions (default: from the pools)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="each engine's KV pool (default: the engines' default): smaller pools make a workload of the same "
        "oversubscription that a 2-core machine runs in minutes, not hours",
    )
    parser.add_argument("--host-bytes", default="16GiB", help="--kv-tier-host-bytes of `all` (with CUDA only)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a deployment may take to start")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a stream may stay silent")
    parser.add_argument("--smoke", action="store_true", help="2 sessions x 2 turns of 260-400 new tokens")
    add_plot_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.sessions, args.turns, args.min_new_tokens, args.max_new_tokens = 2, 2, 260, 400
    args.configs = args.configs.split(",")
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    if not 0 < args.min_new_tokens <= args.max_new_tokens or args.turns < 1 or args.concurrency < 1:
        parser.error("need 0 < --min-new-tokens <= --max-new-tokens, --turns >= 1 and --concurrency >= 1")
    return args


def main() -> None:
    import torch  # after pdserve, which sets the OpenMP spin count torch must start with

    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where `pdserve serve` runs the engines
    if device.type == "cpu":
        args.host_bytes = None  # the host tier is for GPU engines: a CPU pool already is host memory
    results: dict[str, dict[str, Any]] = {}
    answers: dict[str, list[list[Answer | None]]] = {}
    workload: Workload | None = None
    with tempfile.TemporaryDirectory(prefix="pdserve-multiturn-") as scratch_dir:
        scratch = Path(scratch_dir)
        folder = prepare_model(args.model, scratch)
        tokenizer = load_tokenizer(folder)
        kv_bytes_per_token = ModelConfig.from_folder(folder).kv_bytes_per_token(resolve_dtype("auto", device))
        served = Served(args.model, tokenizer, kv_bytes_per_token)
        for name in args.configs:
            print(f"{name}: running", flush=True)
            try:
                with deployment(name, args.model, folder, scratch, args) as servers:
                    if workload is None:
                        workload = make_workload(servers, tokenizer, args)
                    results[name], answers[name] = measure(servers, workload, served, args)
            except ConfigFailed as error:
                results[name] = {"error": str(error)}
            except OSError as error:  # an engine stopped answering (its /metrics, the router)
                results[name] = {"error": f"failed during the run: {type(error).__name__}: {error}"}
    for name, figures in results.items():
        if name in answers:
            figures["same_as_off"] = (
                "{}/{} turns".format(*same_answers(answers[name], answers["off"])) if "off" in answers else "no off run"
            )
    if workload is not None:
        print(
            f"\nmultiturn, {args.model} model: {len(workload.sessions)} sessions x up to {args.turns} turns "
            f"({sum(len(texts) for texts in workload.sessions)} requests), {args.min_new_tokens}-{args.max_new_tokens} "
            f"new user tokens per turn, {args.answer_tokens}-token answers, {args.concurrency} in flight, seed "
            f"{args.seed}; pools {workload.pools['prefill']} + {workload.pools['decode']} blocks of "
            f"{workload.block_size} = {workload.pool_tokens} tokens; distinct KV estimated {workload.estimated_tokens} "
            f"tokens = {workload.estimated_tokens / workload.pool_tokens:.2f}x the pools; max_model_len "
            f"{workload.max_model_len}"
        )
    for name, figures in results.items():
        print_config(name, figures)
    if args.plot:
        plot(args.model, results, args.plot)
    print(json.dumps({"bench": "multiturn", "model": args.model, "configs": results}))


if __name__ == "__main__":
    main()
