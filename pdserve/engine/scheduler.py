"""Scheduler: decides each step which requests advance by how many tokens, and applies results.

One token counter per request, no prefill/decode phases: running requests go first (their
next decode token, or the next chunk of a prompt), then waiting requests are admitted while
the token budget, ``max_num_seqs`` and KV memory allow. When a running request cannot get a
block, the most recently admitted running request is preempted (its blocks freed, recomputed
later; its own freed blocks usually come back as prefix-cache hits). Aborts work in any state.

Under the priority policy (``--scheduling-policy priority``, vLLM's semantics) the queue and the running list
are kept in (priority, ahead, arrival) order, lower values first, and in a priority the requests marked ``ahead``
(a light tenant's, by the router's flow control) before the others: running requests are preempted from the other
end (the largest value, latest arrival), and a waiting request that cannot start for want of blocks or a
``max_num_seqs`` seat displaces running requests that rank after it (a larger value, or the same one not marked
ahead when it is) before the step is scheduled. A step starts waiting requests of one rank only: a less urgent
prompt would lengthen the step that ends with a more urgent request's first token.

A step that will sample a token for a request counts that token as a placeholder until its output
comes back, so the next step can be scheduled before it does (async scheduling, ``EngineCore``):
a running request's next token is scheduled ahead, unless its length cap makes the placeholder its
last; a stop (EOS, stop token or string) found later wastes one step's compute for that request.

KV transfer enters only through the connector hooks (pdserve.kvtransfer.base): remote loads
park a request in WAITING_FOR_REMOTE_KVS, and a finished request's blocks may be held for a
remote reader until the worker reports the send done; what such blocks owe to or await from
other engines is kept by the remote-KV ledger (``RemoteKV``), which the scheduler asks. A hybrid
model's request moves its state slot with its blocks; one whose KV will be handed over (a P/D
prefill leg) runs its last prompt token as a step of its own that leaves the slot as it was
(``SchedulerOutput.state_restores``), so the state handed over is as of the token before, the one
the reader computes from.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pdserve.api.kv_events import EngineLoad
from pdserve.engine.block_pool import KVCacheBlock
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.remote_kv import RemoteKV, Settled
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_config import SchedulerConfig
from pdserve.engine.stats import SchedulerStats
from pdserve.kvtransfer.base import KVConnectorScheduler, NoKVConnector
from pdserve.worker.interface import ModelRunnerOutput, SchedulerOutput, StepGrammar

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


def _before_last_prompt_token(request: Request, num_computed: int, num_new: int) -> int:
    """``num_new`` cut so that a chunk ends before the last prompt token, which then runs alone
    (a request handing over its linear-attention state, as of the token before)."""
    last = request.num_prompt_tokens - 1
    return min(num_new, last - num_computed) if num_computed < last else num_new


def _order(request: Request) -> tuple[int, bool, float]:
    """Where a request stands under the priority policy: lower priority values first, in one those marked ahead,
    then earlier arrivals."""
    return request.priority, not request.ahead, request.arrival_time


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
        self.by_priority = config.scheduling_policy == "priority"
        self.connector = connector or NoKVConnector()
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            block_generations,
            config.num_state_slots,
            config.rows_per_state_slot,
        )
        self.remote_kv = RemoteKV(self.connector, self.kv_cache_manager, config.num_blocks, config.num_state_slots)
        self.kv_cache_manager.block_pool.record_for_connector(
            self.connector.wants_cached_blocks, self.connector.wants_evicted_blocks
        )
        # Every request the scheduler still knows: unfinished ones, and finished ones whose blocks
        # are still held (for a remote reader, or until an in-flight load into them drains).
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        self._watchdog_outputs: list[EngineCoreOutput] = []  # requests the watchdog failed, until the next outputs

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
        if request.num_output_tokens >= request.max_output_tokens:
            raise ValueError(
                f"the request continues {request.num_output_tokens} output tokens; it may have at most "
                f"{request.max_output_tokens}, so nothing is left to generate"
            )
        self.remote_kv.request_added(request)
        self.requests[request.request_id] = request
        request.status = _waiting_status(request)
        if self.by_priority:
            self._enqueue(request)
        else:
            self.waiting.append(request)
        self.connector.request_added(request)

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
                # An aborted hold: its caller left before it could hand the transfer params on.
                if status == RequestStatus.FINISHED_ABORTED and self.remote_kv.cancel_hold(request_id) is not None:
                    self._drop(request)
                continue
            if request.status == _RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def _release(self, request: Request) -> dict[str, Any] | None:
        """A request just finished: free its blocks, unless a load still writes into them (they are freed when
        it drains) or the connector holds them for a remote reader."""
        request_id = request.request_id
        self._finished_since_last_step.add(request_id)
        hold, kv_transfer_params = self.connector.request_finished(
            request, self.kv_cache_manager.transfer_block_ids(request_id), request.status.finish_reason or "abort"
        )
        if self.remote_kv.finished_while_loading(request):
            return None  # its blocks are freed when the load drains
        if hold and request.peer is not None and request.peer.hold:
            held, dropped = self.remote_kv.hold_for_peers(request)
            for older in dropped:
                self._drop(older)
            if held:
                return None
        elif hold and self.remote_kv.hold(request):
            return kv_transfer_params
        self._drop(request)
        return None  # nothing handed over (a refused hold's decode computes the prompt)

    def _allocate(
        self,
        request: Request,
        num_tokens: int,
        hit_blocks: Sequence[KVCacheBlock] = (),
        num_hit_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """``allocate_slots``, freeing blocks held for peer reads (oldest hold first) while the pool has no room:
        they go before a running request is preempted or a waiting one is kept waiting."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(
                request, num_tokens, hit_blocks, num_hit_tokens, delay_cache_blocks
            )
            if blocks is not None:
                return blocks
            held = self.remote_kv.drop_peer_hold()
            if held is None:
                return None
            self._drop(held)

    def _drop(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._forget(request)

    def _forget(self, request: Request) -> None:
        del self.requests[request.request_id]
        self.remote_kv.hands_over.discard(request.request_id)

    def has_work(self) -> bool:
        """Unfinished requests, blocks still waiting on the transfer worker, or work for it."""
        return bool(
            self.waiting
            or self.running
            or self.remote_kv.has_work()
            or self._watchdog_outputs
            or self.connector.has_pending_work()
        )

    # ----- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput[Request]:
        if self.remote_kv.watching:
            self._settle(self.remote_kv.watchdog(time.monotonic()), self._watchdog_outputs)
        config = self.config
        kv = self.kv_cache_manager
        block_table = kv.get_block_ids
        budget = config.max_num_batched_tokens
        scheduled: list[Request] = []
        num_scheduled: list[int] = []
        start_positions: list[int] = []
        block_tables: list[list[int]] = []
        preempted_ids: set[str] = self._make_room_by_priority() if self.by_priority and self.waiting else set()
        shedding = False  # the running requests are preempting each other for blocks
        grammar_rows: list[int] = []  # scheduled requests whose sampled token a grammar constrains

        hands_over = self.remote_kv.hands_over
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
            while self._allocate(request, num_new) is None:
                victim = running.pop()  # the latest admitted; under the priority policy, the largest value
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                shedding = True
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
        if not shedding:
            budget = self._schedule_waiting(
                budget, scheduled, num_scheduled, start_positions, block_tables, grammar_rows
            )

        finished_ids = self._finished_since_last_step
        self._finished_since_last_step = set()
        connector = self.connector
        pool = kv.block_pool
        if pool.evicted_log:
            connector.blocks_evicted(pool.take_evicted())
        if pool.cached_log:
            connector.blocks_cached(pool.take_cached())
        connector.note_step(config.max_num_batched_tokens - budget)
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
            kv_connector_metadata=connector.build_connector_meta(),
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
        if self.remote_kv.finished_recving:
            self._promote_finished_loads()
        parked: list[Request] = []  # still loading remote KV: keep their place in the queue
        first_rank: tuple[int, bool] | None = None  # priority policy: of the first request admitted in this step
        while waiting and budget > 0 and len(running) < max_num_seqs:
            request = waiting[0]
            if first_rank is not None and (request.priority, not request.ahead) > first_rank:
                # Ranked after a request this step starts: it waits for the next step, since its prompt would
                # lengthen the step whose end is the more urgent request's first token.
                break
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
            looked_up = not kv.owns_blocks(request.request_id)
            if looked_up:  # new or preempted: not a landed load
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
                # up again next step.
                parked.append(waiting.popleft())
                continue
            num_new = 0 if load_async else min(request.num_tokens - num_computed, budget)
            if request.request_id in self.remote_kv.hands_over:
                num_new = _before_last_prompt_token(request, num_computed, num_new)
            # A request that waits for a load takes blocks for its whole prompt now: were it to take only the
            # loaded part, requests whose loads landed could fill the pool between them with none able to go on.
            num_slots = num_external + (request.num_tokens - num_computed if load_async else num_new)

            if self._allocate(request, num_slots, hit_blocks, num_local, load_async) is None:
                break  # first come, first served: nobody overtakes a request that does not fit
            waiting.popleft()
            if looked_up:
                kv.count_lookup(request.num_tokens, num_local)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_local
            block_ids = kv.get_block_ids(request.request_id)
            self.connector.update_state_after_alloc(request, kv.transfer_block_ids(request.request_id), num_external)
            if load_async:
                # The tokens being loaded count as computed: the request owns their blocks now.
                request.num_computed_tokens = num_computed
                self.remote_kv.load_started(request, time.monotonic())
                request.status = _WAITING_FOR_REMOTE_KVS
                parked.append(request)
                continue

            request.status = _RUNNING
            if self.by_priority:
                if first_rank is None:
                    first_rank = (request.priority, not request.ahead)
                bisect.insort(running, request, key=_order)
            else:
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
        landed = self.remote_kv.take_landed()
        ready = [r for r in self.waiting if r.request_id in landed]
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
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Queue a new or preempted request: behind the requests whose remote KV has landed (they own blocks, and
        going ahead of them could leave this one preempting itself for want of exactly those blocks, forever),
        then at the head (fcfs: a preempted request goes on first) or in its (priority, arrival) place."""
        waiting = self.waiting
        owns_blocks = self.kv_cache_manager.owns_blocks
        position = 0
        while position < len(waiting) and owns_blocks(waiting[position].request_id):
            position += 1
        if self.by_priority:
            key = _order(request)
            while position < len(waiting) and _order(waiting[position]) <= key:
                position += 1
        waiting.insert(position, request)

    def _make_room_by_priority(self) -> set[str]:
        """Priority policy: the first waiting request able to start now, when it finds no seat or not the blocks for
        its first chunk, displaces running requests that rank after it (a larger priority value, or its own not
        marked ahead when it is; the last ranked, latest first) until it fits. Done before the step is scheduled,
        so nothing displaced was scheduled in it."""
        candidate = next(
            (
                r
                for r in self.waiting
                if r.status in (RequestStatus.WAITING, _PREEMPTED)
                and not r.num_output_placeholders
                and not self.kv_cache_manager.owns_blocks(r.request_id)
            ),
            None,
        )
        preempted: set[str] = set()
        if candidate is None:
            return preempted
        running = self.running
        config = self.config
        # A request whose prompt is pulled from a P/D prefill takes blocks for all of it at once.
        whole = self.connector.expects_remote_kv(candidate)
        rank = (candidate.priority, not candidate.ahead)
        while running and (running[-1].priority, not running[-1].ahead) > rank:  # equals never displace each other
            if len(running) < config.max_num_seqs and self.kv_cache_manager.can_start(
                candidate, None if whole else config.max_num_batched_tokens
            ):
                break
            victim = running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
        return preempted

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
        for request_id, (first_position, entries) in (runner_output.prompt_logprobs or {}).items():
            if request_id in self.requests:
                self.requests[request_id].add_prompt_logprobs(first_position, entries)
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
            status = request.check_stop(token)
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
                if request.structured_output is not None and request.structured_output.dead_end:
                    output.error_status = 400  # the constraint cannot be met with this vocabulary
                output.num_cached_tokens = max(request.num_cached_tokens, 0)
                output.kv_transfer_params = self._release(request)
            outputs.append(output)
        if any_finished:
            self.running = [request for request in self.running if request.status == _RUNNING]
        if runner_output.kv_connector_output is not None:
            self.connector.worker_reported(runner_output.kv_connector_output)
            self._settle(self.remote_kv.update(runner_output.kv_connector_output, time.monotonic()), outputs)
        return outputs

    def _settle(self, settled: Settled, outputs: list[EngineCoreOutput]) -> None:
        """Apply what the ledger says a connector report or the watchdog means for the requests."""
        for request in settled.freed:
            self._drop(request)
        for request in settled.quarantined:
            self._forget(request)  # its blocks are the quarantine's now
        for request in settled.failed:
            self._load_failed(request, outputs)

    def _load_failed(self, request: Request, outputs: list[EngineCoreOutput]) -> None:
        """A remote load failed: recompute the prompt here, or finish the request with an error.

        Its blocks were never cached (caching waits for a load to land), so freeing them cannot
        leave half-written KV reachable through the prefix cache.
        """
        request.num_computed_tokens = 0
        if self.connector.recompute_failed_load(request):
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

    def load(self) -> EngineLoad:
        """The queues and cache usage now (what KV-event batches tell routers), read without handing over the
        samples ``make_stats`` collects for the metrics."""
        return EngineLoad(
            len(self.running),
            len(self.waiting),
            sum(1 for r in self.waiting if r.status == _WAITING_FOR_REMOTE_KVS),
            self._usage(),
            self.remote_kv.num_blocks_held_for_remote,
        )

    def _usage(self) -> float:
        """The share of blocks in use. Blocks only held for peer reads count as free, as cached free blocks do:
        the scheduler takes both back whenever a request needs them (routers and autoscalers read this as load)."""
        kv = self.kv_cache_manager
        return kv.usage - self.remote_kv.num_blocks_only_held_for_peers() / kv.num_blocks

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        slots = kv.state_slots
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_remote_kvs=sum(1 for r in self.waiting if r.status == _WAITING_FOR_REMOTE_KVS),
            kv_cache_usage=self._usage(),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            remote_kv=self.remote_kv.stats(),
            num_state_slots_used=0 if slots is None else slots.num_slots - slots.num_free_slots,
            kv_tiers=self.connector.tier_stats(),
        )
