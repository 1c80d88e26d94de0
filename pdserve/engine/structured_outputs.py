"""StructuredOutputManager: the engine core's side of structured outputs. It compiles each
request's grammar on a small thread pool (with a per-request time bound and a cache of compiles
keyed by the spec), holds each request's matcher (:class:`RequestGrammar`), and fills a step's
token bitmask: one row per sampled request under a grammar, bit t set where token t may come next.

The scheduler never waits for a compile: a request whose grammar is not ready is skipped (status
``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``), except that a P/D decode starts pulling its prompt's
KV meanwhile. The matcher takes each sampled token once, in ``Scheduler.update_from_output``; it
lives as long as the request (a preempted request keeps its output tokens, so its matcher state
stays right).

With a reasoning parser the grammar constrains the answer only: while a request thinks its row
allows every token and its tokens bypass the matcher, which starts after the end marker. Where
the model may choose to think (Qwen3), its first token may also be the start marker.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pdserve.engine.grammar import GrammarSpec, grammar_of, grammar_spec
from pdserve.engine.reasoning import ReasoningMarkers, ReasoningStart

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 10.0
COMPILE_THREADS = 2
CACHED_GRAMMARS = 512


class RequestGrammar:
    """One request's grammar: compiling (``ready`` False), then a matcher over its output tokens."""

    __slots__ = ("dead_end", "deadline", "future", "markers", "matcher", "may_think", "spec", "thinking")

    def __init__(
        self,
        spec: GrammarSpec,
        future: Future[Any],
        timeout: float,
        markers: ReasoningMarkers | None = None,
        start: ReasoningStart = ReasoningStart.ANSWER,
    ) -> None:
        self.spec = spec
        self.future = future
        self.deadline = time.monotonic() + timeout
        self.matcher: Any = None
        # The grammar allows a next character no token of the vocabulary starts with (a literal the
        # tokenizer cannot spell): whatever is sampled breaks it, and the request ends with a 400.
        self.dead_end = False
        self.markers = markers
        self.thinking = start is ReasoningStart.THINKING  # the grammar waits for the end marker
        self.may_think = start is ReasoningStart.OPTIONAL  # until the first token: the start marker may open

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def start(self, matcher: Any, output_token_ids: list[int]) -> str | None:
        """Take the compiled grammar's ``matcher`` and advance it past output already generated (a continued
        stream's); the problem if the grammar does not allow that output (None: it does)."""
        self.matcher = matcher
        for position, token_id in enumerate(output_token_ids):
            if not self.accept(token_id):
                return f"the continued output breaks the request's grammar at token {position} ({token_id})"
        return None

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        markers = self.markers
        if self.thinking:
            assert markers is not None
            self.thinking = token_id != markers.end_id
            return True
        if self.may_think:
            assert markers is not None
            self.may_think = False
            if token_id == markers.start_id:
                self.thinking = True
                return True
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was taken: nothing may follow."""
        return not self.thinking and bool(self.matcher.is_terminated())

    def fill_row(self, bitmask: Any, row: int) -> None:
        """Write the tokens that may come next into ``bitmask[row]`` (a torch int32 tensor of all-ones rows)."""
        if self.thinking or self.matcher.is_terminated():
            return  # any token (a terminated grammar's token is dropped: the request is over)
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.may_think:
            assert self.markers is not None
            word, bit = divmod(self.markers.start_id, 32)
            bitmask[row, word] |= _as_int32(1 << bit)


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        stop_token_ids: list[int],
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
        any_whitespace: bool = False,
        reasoning: tuple[ReasoningMarkers, Callable[[int], bool]] | None = None,
    ) -> None:
        """``vocab_size``: the model's (the logits' width, at least the tokenizer's vocabulary);
        ``stop_token_ids``: the tokens that end the output once the grammar is complete;
        ``reasoning``: the reasoning parser's markers and the tokenizer's whitespace test."""
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.compile_timeout = compile_timeout
        self.any_whitespace = any_whitespace
        self.reasoning = reasoning
        self.words_per_row = (vocab_size + 31) // 32
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self.pending: dict[str, tuple[Any, RequestGrammar]] = {}  # request id -> (request, grammar)
        # The compiles by spec, least recently used first: a spec seen before reuses its compile
        # (or joins it while it runs); a failed one is tried again.
        self._compiles: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self.compile_seconds: list[float] = []  # of each compile, since the last stats
        self.num_compile_failures = 0

    # ----- compiling ------------------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        """Start compiling the request's grammar (sets ``request.structured_output``)."""
        params = request.sampling_params.structured_outputs
        spec = grammar_spec(params, self.any_whitespace)
        compiles = self._compiles
        future = compiles.get(spec)
        if future is None or (future.done() and future.exception() is not None):
            if self._pool is None:
                # Threads, not processes: xgrammar's compile releases the GIL.
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
            future = self._pool.submit(self._compile, spec)
            compiles[spec] = future
            while len(compiles) > CACHED_GRAMMARS:
                compiles.popitem(last=False)
        else:
            compiles.move_to_end(spec)
        markers, start = None, ReasoningStart.ANSWER
        if self.reasoning is not None:
            markers, is_blank = self.reasoning
            start = markers.start_of(request.prompt_token_ids, is_blank)
        grammar = RequestGrammar(spec, future, self.compile_timeout, markers, start)
        request.structured_output = grammar
        if future.done():  # compiled before: ready at once
            problem = grammar.start(self._matcher(future.result()), request.output_token_ids)
            if problem is not None:
                raise ValueError(problem)
        else:
            self.pending[request.request_id] = (request, grammar)

    def _compile(self, spec: GrammarSpec) -> Any:
        started = time.perf_counter()
        compiler = self._compiler or self._make_compiler()
        compiled = compiler.compile_grammar(grammar_of(spec))
        self.compile_seconds.append(time.perf_counter() - started)
        return compiled

    @staticmethod
    def _matcher(compiled: Any) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def _make_compiler(self) -> Any:
        import xgrammar

        from pdserve.api.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_path)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        # Two pool threads may get here at once: both build one, the last assignment wins, and
        # both compilers work (each its own cache); it happens once.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def poll(self) -> list[tuple[Any, str]]:
        """Collect finished compiles: their requests get matchers. Returns (request, message) of
        each whose compile failed or ran out of time; the caller ends those requests."""
        failed: list[tuple[Any, str]] = []
        if not self.pending:
            return failed
        now = time.monotonic()
        for request_id, (request, grammar) in list(self.pending.items()):
            if request.is_finished:  # aborted while compiling: nothing to report
                del self.pending[request_id]
            elif grammar.future.done():
                del self.pending[request_id]
                error = grammar.future.exception()
                if error is not None:
                    self.num_compile_failures += 1
                    logger.warning("request %s: its grammar could not be compiled: %s", request_id, error)
                    failed.append((request, f"{grammar.spec.param} could not be compiled: {error}"))
                    continue
                problem = grammar.start(self._matcher(grammar.future.result()), request.output_token_ids)
                if problem is not None:
                    failed.append((request, problem))
            elif now >= grammar.deadline:
                del self.pending[request_id]
                self.num_compile_failures += 1
                failed.append((request, f"{grammar.spec.param} did not compile within {self.compile_timeout:g} s"))
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a pending compile ends or ``timeout`` passes: a core with nothing else to do
        must not spin on the GIL the compile threads need."""
        futures = [grammar.future for _, grammar in self.pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        """The request ended: stop tracking its compile (the compile itself runs to its end)."""
        self.pending.pop(request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.pending)

    # ----- each step --------------------------------------------------------------------------------

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> np.ndarray:
        """The packed bitmask ``[len(grammars), words_per_row]`` (int32) of the next token of each."""
        import torch

        bitmask = torch.full((len(grammars), self.words_per_row), -1, dtype=torch.int32)
        for row, grammar in enumerate(grammars):
            grammar.fill_row(bitmask, row)
        packed = bitmask.numpy()
        for empty in np.flatnonzero(~packed.any(axis=1)).tolist():
            grammars[empty].dead_end = True
        return packed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _as_int32(value: int) -> int:
    """A 32-bit word's bit pattern as the signed int a torch int32 holds."""
    return value - (1 << 32) if value >= 1 << 31 else value
