"""Scheduler: decides each step which requests advance by how many tokens, and applies results.

One token counter per request, no prefill/decode phases: running requests go first (their
next decode token, or the next chunk of a prompt), then waiting requests are admitted while
the token budget, ``max_num_seqs`` and KV memory allow. When a running request cannot get a
block, the most recently admitted running request is preempted (its blocks freed, recomputed
later; its own freed blocks usually come back as prefix-cache hits). Aborts work in any state.

A step that will sample a token for a request counts that token as a placeholder until its output
comes back, so the next step can be scheduled before it does (async scheduling, ``EngineCore``):
a running request's next token is scheduled ahead, unless its length cap makes the placeholder its
last; a stop (EOS, stop token or string) found later wastes one step's compute for that request.

KV transfer enters only through the connector hooks (pdserve.kvtransfer.base): remote loads
park a request in WAITING_FOR_REMOTE_KVS, and a finished request's blocks may be held for a
remote reader until the worker reports the send done. A hybrid model's request moves its state
slot with its blocks; one whose KV will be handed over (a P/D prefill leg) runs its last prompt
token as a step of its own that leaves the slot as it was (``SchedulerOutput.state_restores``),
so the state handed over is as of the token before, the one the reader computes from.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.engine.block_pool import KVCacheBlock
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvtransfer.base import KVConnectorOutput, KVConnectorScheduler, NoKVConnector
from pdserve.worker.interface import ModelRunnerOutput, SchedulerOutput, StepGrammar, TokenLogprobs

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    num_state_slots: int = 0  # hybrid models: linear-attention state slots (one per running request)
    rows_per_state_slot: int = 0  # cache rows each slot takes, after the pool's blocks

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            # Otherwise one long request could need more blocks than exist and never finish.
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of {self.block_size}), "
                f"less than max_model_len={self.max_model_len}: give the cache more memory or lower "
                "max_model_len"
            )


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kvs: int
    num_blocks_held_for_remote: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # KV transfer: cumulative totals, and the durations of the pulls finished since the last stats.
    kv_transfer_bytes: int = 0
    kv_transfer_failures: int = 0
    kv_lease_expirations: int = 0
    kv_transfer_seconds: list[float] = field(default_factory=list)
    kv_release_failures: int = 0  # "free these blocks" messages the worker side could not send
    # Side-channel frames the transfer agent refused, by reason (cumulative).
    kv_side_channel_rejected: dict[str, int] = field(default_factory=dict)
    kv_loads_abandoned: int = 0  # loads the watchdog ended because the worker side never reported them
    kv_quarantines_overdue: int = 0  # their quarantines that outlived the alarm (blocks kept out of use: leaked)
    kv_holds_refused: int = 0  # finished prefill legs not held: the held share of the cache was at its cap
    num_blocks_quarantined: int = 0  # blocks of abandoned loads, kept out of use until no write can land
    # Hybrid models: state slots owned by requests (running, loading, held or quarantined), and those
    # of finished prefill legs held for remote readers.
    num_state_slots_used: int = 0
    num_state_slots_held_for_remote: int = 0
    # Structured outputs (set by the engine core): grammars compiling now, compiles failed (cumulative),
    # and since the last stats the compile time of each grammar and the bitmask fill time of each step.
    num_waiting_for_grammar: int = 0
    grammar_compile_failures: int = 0
    grammar_compile_seconds: list[float] = field(default_factory=list)
    grammar_bitmask_seconds: list[float] = field(default_factory=list)


def _before_last_prompt_token(request: Request, num_computed: int, num_new: int) -> int:
    """``num_new`` cut so that a chunk ends before the last prompt token, which then runs alone
    (a request handing over its linear-attention state, as of the token before)."""
    last = request.num_prompt_tokens - 1
    return min(num_new, last - num_computed) if num_computed < last else num_new


def _waiting_status(request: Request) -> RequestStatus:
    """A queued request waits for its grammar until the grammar is compiled."""
    grammar = request.structured_output
    return _WAITING_FOR_GRAMMAR if grammar is not None and not grammar.ready else RequestStatus.WAITING


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        connector: KVConnectorScheduler | None = None,
        block_generations: np.ndarray | None = None,
    ) -> None:
        """``block_generations``: the pool's generation array when a KV connector made (and
        registered) it first; else the pool makes its own."""
        self.config = config
        self.connector = connector or NoKVConnector()
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            block_generations,
            config.num_state_slots,
            config.rows_per_state_slot,
        )
        # Every request the scheduler still knows: unfinished ones, and finished ones whose blocks
        # are still held (for a remote reader, or until an in-flight load into them drains).
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held_for_remote: dict[str, Request] = {}
        self._num_held_blocks = 0  # owned by held_for_remote's requests
        self.max_held_blocks = int(self.connector.max_held_fraction * config.num_blocks)
        self.max_held_slots = int(self.connector.max_held_fraction * config.num_state_slots)
        # Hybrid models: requests whose KV (and state) will be handed over when they finish.
        self._hands_over: set[str] = set()
        self.kv_holds_refused = 0
        self.aborted_while_loading: dict[str, Request] = {}
        self.finished_recving: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_failures = 0
        self.kv_lease_expirations = 0
        self.kv_release_failures = 0
        self.kv_side_channel_rejected: dict[str, int] = {}
        self.kv_loads_abandoned = 0
        self._kv_transfer_seconds: list[float] = []
        # The watchdog: loads handed to the connector must be reported by these times. Blocks of abandoned
        # loads stay quarantined until the load is reported (no write into them can land any more), however
        # long that takes: past these times a quarantine is counted overdue and logged, never ended.
        self._load_deadlines: dict[str, float] = {}
        self._quarantine_alarms: dict[str, float] = {}
        self.kv_quarantines_overdue = 0
        self._watchdog_outputs: list[EngineCoreOutput] = []

    # ----- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        max_model_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, but the context length is "
                f"{max_model_len}: at most {max_model_len - 1} prompt tokens leave room for output"
            )
        room = max_model_len - request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        request.max_output_tokens = room if max_tokens is None else min(max_tokens, room)
        hands_over = self.kv_cache_manager.state_slots is not None and self.connector.hands_over(request)
        if hands_over and request.max_output_tokens != 1:
            # What it hands over is the state before its last prompt token: further tokens would build on
            # that state, not on the one their prompt leaves.
            raise ValueError("a prefill leg (kv_transfer_params.do_remote_decode) of a hybrid model samples one token")
        self.requests[request.request_id] = request
        request.status = _waiting_status(request)
        self.waiting.append(request)
        self.connector.request_added(request)
        if hands_over:
            self._hands_over.add(request.request_id)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """End requests in any state (abort by default); unknown or finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.is_finished:
                if request_id in self.held_for_remote and status == RequestStatus.FINISHED_ABORTED:
                    # Its caller left before it could hand the transfer params on: nobody will pull
                    # these blocks, so they need not wait for the lease.
                    self._end_hold(request_id)
                    self.connector.hold_cancelled(request_id)
                    self._drop(request)
                continue
            was_loading = request.status == _WAITING_FOR_REMOTE_KVS and request_id not in self.finished_recving
            if request.status == _RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request, load_in_flight=was_loading)

    def _release(self, request: Request, load_in_flight: bool = False) -> dict[str, Any] | None:
        """A request just finished: free its blocks, or hold them if the connector asks to."""
        request_id = request.request_id
        self._finished_since_last_step.add(request_id)
        hold, kv_transfer_params = self.connector.request_finished(
            request, self.kv_cache_manager.transfer_block_ids(request_id), request.status.finish_reason or "abort"
        )
        if load_in_flight:
            # The worker may still be writing into these blocks: freeing them now could let
            # another request's KV be overwritten. They are freed when the load drains.
            self.aborted_while_loading[request_id] = request
        elif hold:
            num_blocks = self.kv_cache_manager.num_owned_blocks(request_id)
            over_slots = (
                self.kv_cache_manager.state_slots is not None and len(self.held_for_remote) >= self.max_held_slots
            )
            if self._num_held_blocks + num_blocks > self.max_held_blocks or over_slots:
                # Holding more for remote readers would starve this engine's own requests: this one
                # hands nothing over (its answer has no params; its decode computes the prompt).
                self.connector.hold_cancelled(request_id)
                self.kv_holds_refused += 1
                self._drop(request)
                return None
            self.held_for_remote[request_id] = request
            self._num_held_blocks += num_blocks
        else:
            self._drop(request)
        return kv_transfer_params

    def _end_hold(self, request_id: str) -> Request | None:
        request = self.held_for_remote.pop(request_id, None)
        if request is not None:
            self._num_held_blocks -= self.kv_cache_manager.num_owned_blocks(request_id)
        return request

    def _drop(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._hands_over.discard(request.request_id)

    def has_work(self) -> bool:
        """Unfinished requests, blocks still waiting on the transfer worker, or work for it."""
        return bool(
            self.waiting
            or self.running
            or self.held_for_remote
            or self.aborted_while_loading
            or self._quarantine_alarms
            or self._watchdog_outputs
            or self.connector.has_pending_work()
        )

    # ----- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput[Request]:
        if self._load_deadlines or self._quarantine_alarms:
            self._watchdog(time.monotonic())
        config = self.config
        kv = self.kv_cache_manager
        block_table = kv.get_block_ids
        budget = config.max_num_batched_tokens
        scheduled: list[Request] = []
        num_scheduled: list[int] = []
        start_positions: list[int] = []
        block_tables: list[list[int]] = []
        preempted_ids: set[str] = set()
        grammar_rows: list[int] = []  # scheduled requests whose sampled token a grammar constrains

        hands_over = self._hands_over
        running = self.running
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            num_new = request.num_tokens + placeholders - num_computed
            if placeholders and (num_new <= 0 or request.num_output_tokens + placeholders >= request.max_output_tokens):
                index += 1  # its last token is on its way (async scheduling): nothing more to compute for it
                continue
            if num_new > budget:
                num_new = budget
            if hands_over and request.request_id in hands_over:
                num_new = _before_last_prompt_token(request, num_computed, num_new)
            while kv.allocate_slots(request, num_new) is None:
                victim = running.pop()
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(request)
                num_scheduled.append(num_new)
                start_positions.append(num_computed)
                block_tables.append(block_table(request.request_id))
                request.num_computed_tokens = num_computed + num_new
                if num_computed + num_new == request.num_tokens + placeholders:  # it samples a token
                    request.num_output_placeholders = placeholders + 1
                    if request.structured_output is not None:
                        grammar_rows.append(len(scheduled) - 1)
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: everyone after it is already preempted

        # Admitting new work while the running set is shedding blocks would just thrash.
        if not preempted_ids:
            budget = self._schedule_waiting(
                budget, scheduled, num_scheduled, start_positions, block_tables, grammar_rows
            )

        finished_ids = self._finished_since_last_step
        self._finished_since_last_step = set()
        state_slots = restores = None
        if kv.state_slots is not None:
            slot_of = kv.state_slots.slot_of
            state_slots = [slot_of(request.request_id) for request in scheduled]
            if hands_over:
                restores = [
                    slot
                    for request, slot, start in zip(scheduled, state_slots, start_positions, strict=True)
                    if request.request_id in hands_over and start == request.num_prompt_tokens - 1
                ]
        return SchedulerOutput(
            requests=scheduled,
            num_scheduled_tokens=num_scheduled,
            start_positions=start_positions,
            block_ids=block_tables,
            total_num_scheduled_tokens=config.max_num_batched_tokens - budget,
            preempted_req_ids=preempted_ids,
            finished_req_ids=finished_ids,
            kv_connector_metadata=self.connector.build_connector_meta(),
            grammar=StepGrammar(grammar_rows) if grammar_rows else None,
            state_slots=state_slots,
            state_restores=restores or None,
        )

    def _schedule_waiting(
        self,
        budget: int,
        scheduled: list[Request],
        num_scheduled: list[int],
        start_positions: list[int],
        block_tables: list[list[int]],
        grammar_rows: list[int],
    ) -> int:
        kv = self.kv_cache_manager
        waiting = self.waiting
        running = self.running
        max_num_seqs = self.config.max_num_seqs
        if self.finished_recving:
            self._promote_finished_loads()
        parked: list[Request] = []  # still loading remote KV: keep their place in the queue
        while waiting and budget > 0 and len(running) < max_num_seqs:
            request = waiting[0]
            if request.status == _WAITING_FOR_REMOTE_KVS or request.num_output_placeholders:
                # Loading remote KV, or preempted while its last token is on its way (its recompute
                # needs that token).
                parked.append(waiting.popleft())
                continue
            grammar = request.structured_output
            grammar_pending = grammar is not None and not grammar.ready
            if grammar_pending:
                # Whatever its status says (a failed load sends a request back to WAITING): it may
                # not sample before its grammar is ready.
                if kv.owns_blocks(request.request_id) or not self.connector.expects_remote_kv(request):
                    request.status = _WAITING_FOR_GRAMMAR
                    parked.append(waiting.popleft())
                    continue
                # else: admitted now for its remote KV, which is pulled while its grammar compiles
            elif request.status == _WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING

            hit_blocks: list[KVCacheBlock] = []
            num_external = 0
            load_async = False
            if not kv.owns_blocks(request.request_id):  # new or preempted: not a landed load
                hit_blocks, num_local = kv.get_computed_blocks(request)
                num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
                if not load_async:
                    # A synchronous load lands before this step's forward: the last token must
                    # still be computed here to produce logits.
                    num_external = min(num_external, request.num_tokens - 1 - num_local)
            else:
                num_local = 0
            num_computed = request.num_computed_tokens + num_local + num_external
            if grammar_pending and not load_async:
                # Expected remote KV, but nothing is to be pulled (the prompt is cached here): it
                # would compute and sample now, and its grammar is not ready. Rare; it is looked
                # up again next step (the prefix-cache counters count each look).
                parked.append(waiting.popleft())
                continue
            num_new = 0 if load_async else min(request.num_tokens - num_computed, budget)
            if request.request_id in self._hands_over:
                num_new = _before_last_prompt_token(request, num_computed, num_new)

            if (
                kv.allocate_slots(request, num_new + num_external, hit_blocks, num_local, delay_cache_blocks=load_async)
                is None
            ):
                break  # first come, first served: nobody overtakes a request that does not fit
            waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_local
            block_ids = kv.get_block_ids(request.request_id)
            self.connector.update_state_after_alloc(request, kv.transfer_block_ids(request.request_id), num_external)
            if load_async:
                # The tokens being loaded count as computed: the request owns their blocks now.
                request.num_computed_tokens = num_computed
                if self.connector.load_report_timeout is not None:
                    self._load_deadlines[request.request_id] = time.monotonic() + self.connector.load_report_timeout
                request.status = _WAITING_FOR_REMOTE_KVS
                parked.append(request)
                continue

            request.status = _RUNNING
            running.append(request)
            scheduled.append(request)
            num_scheduled.append(num_new)
            start_positions.append(num_computed)
            block_tables.append(block_ids)
            request.num_computed_tokens = num_computed + num_new
            if num_computed + num_new == request.num_tokens:  # it samples a token
                request.num_output_placeholders = 1
                if request.structured_output is not None:
                    grammar_rows.append(len(scheduled) - 1)
            budget -= num_new
        waiting.extendleft(reversed(parked))
        return budget

    def _promote_finished_loads(self) -> None:
        """Requests whose remote KV has landed become schedulable and go to the queue's head:
        they already own their blocks (see ``_preempt``)."""
        ready = [r for r in self.waiting if r.request_id in self.finished_recving]
        self.finished_recving.clear()
        for request in ready:
            self.waiting.remove(request)
            if request.num_computed_tokens >= request.num_tokens:
                # The whole prompt arrived; recompute its last token to get logits for the next one.
                request.num_computed_tokens = request.num_tokens - 1
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.status = _waiting_status(request)
        self.waiting.extendleft(reversed(ready))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the head of the queue, but behind requests whose remote KV has landed: they own
        # blocks, and going ahead of them could leave this one preempting itself for want of
        # exactly those blocks, forever.
        waiting = self.waiting
        owns_blocks = self.kv_cache_manager.owns_blocks
        position = 0
        while position < len(waiting) and owns_blocks(waiting[position].request_id):
            position += 1
        waiting.insert(position, request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput[Request], runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, release finished requests."""
        outputs: list[EngineCoreOutput] = []
        if self._watchdog_outputs:
            outputs, self._watchdog_outputs = self._watchdog_outputs, []
        any_finished = False
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        if runner_output.prompt_logprobs:
            self._collect_prompt_logprobs(runner_output.prompt_logprobs)
        for index, request in enumerate(scheduler_output.requests):
            token = sampled[index]
            if token < 0:
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            # A request preempted after this step was scheduled keeps the token (async scheduling).
            was_preempted = request.status == _PREEMPTED
            if request.status != _RUNNING and not was_preempted:
                continue
            request.append_output_token(token)
            status = self._check_stop(request, token)
            grammar = request.structured_output
            if grammar is not None:
                if not grammar.accept(token):
                    status = RequestStatus.FINISHED_ERROR
                    request.stop_reason = (
                        "no token of the model's vocabulary continues the grammar here"
                        if grammar.dead_end
                        else f"token {token} broke the request's grammar"  # an unmasked sample: a bug
                    )
                elif grammar.is_terminated:
                    status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
            if status is None and logprobs is None and request.prompt_logprobs is None:
                outputs.append(EngineCoreOutput(request.request_id, [token]))
                continue
            output = EngineCoreOutput(request.request_id, [token])
            entry = logprobs[index] if logprobs is not None else None
            if entry is not None:
                output.new_logprobs = [entry]
            if request.prompt_logprobs is not None and len(request.output_token_ids) == 1:
                output.prompt_logprobs = request.prompt_logprobs
            if status is not None:
                if was_preempted:
                    self.waiting.remove(request)
                request.status = status
                any_finished = True
                output.finish_reason = status.finish_reason
                output.stop_reason = request.stop_reason
                if grammar is not None and grammar.dead_end:
                    output.error_status = 400  # the constraint cannot be met with this vocabulary
                output.num_cached_tokens = max(request.num_cached_tokens, 0)
                output.kv_transfer_params = self._release(request)
            outputs.append(output)
        if any_finished:
            self.running = [request for request in self.running if request.status == _RUNNING]
        if runner_output.kv_connector_output is not None:
            self._update_from_connector(runner_output.kv_connector_output, outputs)
        return outputs

    def _collect_prompt_logprobs(self, prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]) -> None:
        for request_id, (first_position, entries) in prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            collected = request.prompt_logprobs if request.prompt_logprobs is not None else []
            # A recomputed (preempted) prompt reports positions it already reported: keep the first.
            skip = len(collected) - first_position
            if skip < len(entries):
                collected.extend(entries[max(skip, 0) :])
            request.prompt_logprobs = collected

    @staticmethod
    def _check_stop(request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            # A stop on the last allowed token reports "stop": the model did stop there.
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_id_set:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _update_from_connector(self, connector_output: KVConnectorOutput, outputs: list[EngineCoreOutput]) -> None:
        for num_bytes, seconds in connector_output.transfers:
            self.kv_transfer_bytes += num_bytes
            self._kv_transfer_seconds.append(seconds)
        self.kv_transfer_failures += connector_output.num_failed_transfers
        self.kv_lease_expirations += connector_output.num_expired_leases
        self.kv_release_failures += connector_output.num_failed_releases
        for reason, count in connector_output.rejected_messages.items():
            self.kv_side_channel_rejected[reason] = self.kv_side_channel_rejected.get(reason, 0) + count
        for request_id in connector_output.finished_sending:
            request = self._end_hold(request_id)
            if request is not None:
                self._drop(request)
        now = time.monotonic()
        for request_id in connector_output.failed_recving_in_flight:
            # Failed, but a write into its blocks may still land: quarantined until the worker side
            # says it drained (reported below, now or later).
            self._load_deadlines.pop(request_id, None)
            if self._quarantine_load(request_id, now, outputs):
                logger.warning("request %s: its KV load failed while still writing; its blocks quarantined", request_id)
        for request_id in connector_output.finished_recving:
            if self._load_reported(request_id):
                continue
            request = self.aborted_while_loading.pop(request_id, None)
            if request is not None:
                self._drop(request)
            elif self._loading(request_id):
                self.finished_recving.add(request_id)
        for request_id in connector_output.failed_recving:
            if self._load_reported(request_id):
                continue
            request = self.aborted_while_loading.pop(request_id, None)
            if request is not None:
                self._drop(request)
            elif self._loading(request_id):
                self._load_failed(self.requests[request_id], outputs)

    def _loading(self, request_id: str) -> bool:
        """The request waits for its load (a report about any other is late: it changes nothing)."""
        request = self.requests.get(request_id)
        return request is not None and request.status == _WAITING_FOR_REMOTE_KVS

    def _load_reported(self, request_id: str) -> bool:
        """A load's end came in; True if the watchdog had abandoned it already (its report now only
        ends the quarantine of its old blocks, whatever the request does meanwhile)."""
        self._load_deadlines.pop(request_id, None)
        if request_id not in self._quarantine_alarms:
            return False
        del self._quarantine_alarms[request_id]
        self.kv_cache_manager.release_quarantine(request_id)
        return True

    def _watchdog(self, now: float) -> None:
        """Fail loads the worker side never reported, quarantining their blocks (a write into them
        may still land); count and log quarantines that outlived their alarm: their blocks stay out of use,
        since only the load's report says that no write can land in them any more."""
        for request_id, alarm in list(self._quarantine_alarms.items()):
            if alarm <= now:
                self._quarantine_alarms[request_id] = float("inf")  # counted once
                self.kv_quarantines_overdue += 1
                logger.error(
                    "request %s: its abandoned KV load is still not reported; its blocks stay quarantined "
                    "(leaked until the transfer agent reports it; pdserve_kv_quarantines_overdue_total)",
                    request_id,
                )
        for request_id, deadline in list(self._load_deadlines.items()):
            if deadline <= now:
                del self._load_deadlines[request_id]
                self._abandon_load(request_id, now)

    def _abandon_load(self, request_id: str, now: float) -> None:
        if self._quarantine_load(request_id, now, self._watchdog_outputs):
            logger.warning(
                "request %s: its KV load was not reported within %.0f s; failed, its blocks quarantined",
                request_id,
                self.connector.load_report_timeout,
            )
            self.kv_transfer_failures += 1
            self.kv_loads_abandoned += 1

    def _quarantine_load(self, request_id: str, now: float, outputs: list[EngineCoreOutput]) -> bool:
        """Fail a load whose blocks a write may still reach: the blocks leave the request for the
        quarantine (until the load is reported; overdue past ``quarantine_alarm_seconds``), and the request
        recomputes or fails. False if the request no longer waits for that load."""
        kv = self.kv_cache_manager
        request = self.aborted_while_loading.pop(request_id, None)
        if request is not None:
            kv.quarantine(request)
            del self.requests[request_id]
            self._hands_over.discard(request_id)
        else:
            request = self.requests.get(request_id)
            if request is None or request.status != _WAITING_FOR_REMOTE_KVS or request_id in self.finished_recving:
                return False
            kv.quarantine(request)
            self._load_failed(request, outputs)
        self._quarantine_alarms[request_id] = now + self.connector.quarantine_alarm_seconds
        return True

    def _load_failed(self, request: Request, outputs: list[EngineCoreOutput]) -> None:
        """A remote load failed: recompute the prompt here, or finish the request with an error.

        Its blocks were never cached (caching waits for a load to land), so freeing them cannot
        leave half-written KV reachable through the prefix cache.
        """
        request.num_computed_tokens = 0
        if self.connector.recompute_failed_loads:
            self.kv_cache_manager.free(request)
            request.status = _waiting_status(request)  # keeps its place; admitted again as a new request
            return
        self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        self._release(request)  # frees its blocks
        outputs.append(
            EngineCoreOutput(request.request_id, [], finish_reason="error", stop_reason="the remote KV transfer failed")
        )

    def fail_requests(self, failures: Iterable[tuple[Request, str]], error_status: int) -> list[EngineCoreOutput]:
        """End unfinished requests with an error (``error_status``: the HTTP status their callers
        get); one output each, saying why."""
        outputs = []
        for request, message in failures:
            if request.is_finished:
                continue
            request.stop_reason = message
            self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            outputs.append(
                EngineCoreOutput(
                    request.request_id, [], finish_reason="error", stop_reason=message, error_status=error_status
                )
            )
        return outputs

    # ----- observation ----------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        transfer_seconds, self._kv_transfer_seconds = self._kv_transfer_seconds, []
        slots_used, slots_held = self._state_slot_stats()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_remote_kvs=sum(1 for r in self.waiting if r.status == _WAITING_FOR_REMOTE_KVS),
            num_blocks_held_for_remote=self._num_held_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            kv_transfer_bytes=self.kv_transfer_bytes,
            kv_transfer_failures=self.kv_transfer_failures,
            kv_lease_expirations=self.kv_lease_expirations,
            kv_transfer_seconds=transfer_seconds,
            kv_release_failures=self.kv_release_failures,
            kv_side_channel_rejected=dict(self.kv_side_channel_rejected),
            kv_loads_abandoned=self.kv_loads_abandoned,
            kv_quarantines_overdue=self.kv_quarantines_overdue,
            kv_holds_refused=self.kv_holds_refused,
            num_blocks_quarantined=kv.num_quarantined_blocks,
            num_state_slots_used=slots_used,
            num_state_slots_held_for_remote=slots_held,
        )

    def _state_slot_stats(self) -> tuple[int, int]:
        """(state slots owned, those of requests held for remote readers); zeros without slots."""
        slots = self.kv_cache_manager.state_slots
        if slots is None:
            return 0, 0
        held = sum(1 for request_id in self.held_for_remote if slots.has_slot(request_id))
        return slots.num_slots - slots.num_free_slots, held
