"""Request and RequestStatus: the one record of a request's tokens and progress inside a core.

Every phase (prefill, chunked prefill, prefix-cache hit, remote KV load, decode) is the same
motion of one counter: ``num_computed_tokens`` climbs towards ``num_tokens``. The scheduler
moves it; the KV-cache manager owns the blocks behind it.
"""

from __future__ import annotations

import enum
import time

from pdserve.api.peer_kv import PeerKV
from pdserve.engine.block_hash import BlockHash
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_outputs import RequestGrammar
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.worker.interface import TokenLogprobs


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > RequestStatus.PREEMPTED`` means finished."""

    WAITING = 0
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 1
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` for a finished status, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    __slots__ = (
        "ahead",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "eos_token_id",
        "max_output_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "peer",
        "priority",
        "prompt_logprobs",
        "prompt_token_ids",
        "remote_decode",
        "remote_prefill",
        "request_id",
        "sampling_params",
        "status",
        "stop_reason",
        "structured_output",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        remote_prefill: RemotePrefill | None = None,
        remote_decode: bool = False,
        peer: PeerKV | None = None,
        output_token_ids: list[int] | None = None,
        priority: int = 0,
        ahead: bool = False,
    ) -> None:
        """``remote_prefill``: a P/D decode leg's remote blocks, screened by the API process (pdserve/server/
        pd_gate.py); ``remote_decode``: a P/D prefill leg, whose KV is held for a decode engine when it ends;
        ``peer``: hold its blocks for peer reads when it ends, or read its prompt's leading blocks from a peer;
        ``output_token_ids``: output another engine generated (a continued stream): the request starts as a
        preempted one resumes, computing prompt and output, and samples what follows them; ``priority``: under
        the priority scheduling policy, lower values go first (vLLM's semantics; ignored under fcfs); ``ahead``: under
        that policy, it goes before the requests of its priority that are not (the router's flow control marks a
        tenant's request when the tenant had none in flight and others of its band had)."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.remote_prefill = remote_prefill
        self.remote_decode = remote_decode
        self.peer = peer
        self.priority = priority
        self.ahead = ahead
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(output_token_ids or ())
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        # Tokens a scheduled step samples for this request that have not come back yet: the scheduler
        # counts them as known (async scheduling schedules the next step before they arrive).
        self.num_output_placeholders = 0
        # Prompt tokens served from the local prefix cache on first scheduling (usage's cached_tokens).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        # Set by the scheduler when the request is added (max_tokens capped by the context length).
        self.max_output_tokens = sampling_params.max_tokens or 0
        self.stop_reason: int | str | None = None
        # Filled chunk by chunk when sampling_params.prompt_logprobs is set (TokenLogprobs entries).
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        # Its grammar and matcher when it asked for structured output (StructuredOutputManager sets it).
        self.structured_output: RequestGrammar | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, token: int) -> RequestStatus | None:
        """The finished status the output token just appended, ``token``, ends this request with (None: it goes
        on): EOS, a stop token, the length cap, or its grammar, complete or broken; ``stop_reason`` says why."""
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        status = None
        if num_output >= params.min_tokens and token == self.eos_token_id and not params.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED  # on the last allowed token too: the model did stop there
        elif num_output >= params.min_tokens and token in params.stop_token_id_set:
            self.stop_reason = token
            status = RequestStatus.FINISHED_STOPPED
        elif num_output >= self.max_output_tokens:
            status = RequestStatus.FINISHED_LENGTH_CAPPED
        grammar = self.structured_output
        if grammar is None:
            return status
        if not grammar.accept(token):  # advances the grammar whatever the status
            self.stop_reason = (
                "no token of the model's vocabulary continues the grammar here"
                if grammar.dead_end
                else f"token {token} broke the request's grammar"  # an unmasked sample: a bug
            )
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated else status

    def add_prompt_logprobs(self, first_position: int, entries: list[TokenLogprobs]) -> None:
        """Prompt logprobs from position ``first_position`` on; a recomputed (preempted) prompt reports
        positions it already reported: the first report of each is kept."""
        collected = self.prompt_logprobs if self.prompt_logprobs is not None else []
        skip = len(collected) - first_position
        if skip < len(entries):
            collected.extend(entries[max(skip, 0) :])
        self.prompt_logprobs = collected

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, out={self.num_output_tokens})"
        )
