"""EngineCore: one step = schedule → execute the model → update from its output.

The core owns the scheduler (and through it all KV memory state) and a model executor. It runs
wherever the caller puts it: in-process for the offline API and tests, or in its own process
behind ZMQ for the servers (``core_process``). Callers use only the methods here; nothing
outside the core reaches into the scheduler's KV-cache manager or block pool.

With async scheduling (workers in processes of their own) a step is one ahead: the core schedules
and sends step N+1, then takes step N's output, so the workers go from one step to the next while
the core does its own work (scheduling, the step's encoding, applying outputs). Each step's outputs
come back one call later; a schedule with nothing to compute runs synchronously after the step in
flight (it only polls the KV connector and carries finished ids).

Structured outputs: each step first collects finished grammar compiles (a failed one ends its
request with a 400). A step whose samples a grammar constrains has its token bitmask filled while
the forward runs: by a helper thread for a runner in this process, or, for workers in processes,
after the step went out (under async scheduling, after the previous step's tokens were applied,
since the bitmask depends on them) and sent after it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from pdserve.api.kv_events import TierEvents
from pdserve.engine.block_hash import BlockHash
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_config import SchedulerConfig
from pdserve.engine.stats import SchedulerStats
from pdserve.engine.structured_outputs import StructuredOutputManager
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.worker.interface import (
    ModelExecutor,
    ModelRunnerOutput,
    PipelinedModelExecutor,
    SchedulerOutput,
    StepGrammar,
)

# A grammar that failed to compile is the caller's input problem: the request gets this status.
GRAMMAR_FAILED_STATUS = 400
# A step with nothing to compute while grammars compile waits this long for one of them.
GRAMMAR_IDLE_WAIT_S = 0.002


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        model_executor: ModelExecutor | PipelinedModelExecutor,
        async_scheduling: bool = False,
        structured_outputs: StructuredOutputManager | None = None,
        kv_cache_dtype: str = "",
        startup_phases: list[tuple[str, float]] | None = None,
    ) -> None:
        """``async_scheduling`` needs a ``PipelinedModelExecutor`` (workers in processes of their own);
        ``structured_outputs``: None refuses requests that ask for structured output; ``kv_cache_dtype``:
        what the KV cache stores ("bfloat16"), for what the engine tells routers; ``startup_phases``: how
        its start went, (name, seconds) in order, for ``/metrics``."""
        self.scheduler = scheduler
        self.model_executor = model_executor
        self.async_scheduling = async_scheduling
        self.structured_outputs = structured_outputs
        self.kv_cache_dtype = kv_cache_dtype
        self.startup_phases = startup_phases or []
        self.startup_seconds = 0.0  # the whole build, phases and all (set by the builder)
        self._pipelined = hasattr(model_executor, "submit")
        self._bitmask_filler: ThreadPoolExecutor | None = None  # for a runner in this process
        self._bitmask_seconds: list[float] = []  # fill time of each constrained step, since the last stats
        self._in_flight: SchedulerOutput[Request] | None = None  # async: sent, output not taken yet
        self._compute_threads: int | None = None  # the CPU runner's threads as of its last step (None: not said)
        # True when the last step computed nothing (it only waited on KV transfers): the process
        # loop then sleeps briefly instead of spinning.
        self.last_step_idle = False

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def kv_compat_hash(self) -> str | None:
        """The KV compatibility hash engines pair by (None for an engine that moves no KV)."""
        return self.scheduler.connector.compat_hash

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never run."""
        if request.sampling_params.structured_outputs is not None:
            if self.structured_outputs is None:
                raise ValueError("this engine does not serve structured outputs")
            self.structured_outputs.add_request(request)  # its grammar compiles from now on
        try:
            self.scheduler.add_request(request)
        except ValueError:
            if self.structured_outputs is not None:
                self.structured_outputs.forget(request.request_id)
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests the caller decided are done (a stop string found in their text)."""
        self.scheduler.finish_requests(request_ids, status)

    def release_remote(self, remote: RemotePrefill | None) -> None:
        """A request naming ``remote`` blocks was refused before it was queued: their prefill engine
        may free them."""
        self.scheduler.connector.release_remote(remote)

    def step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if self.structured_outputs is not None and self.structured_outputs.pending:
            failures = self.structured_outputs.poll()
            if failures:
                outputs = self.scheduler.fail_requests(failures, GRAMMAR_FAILED_STATUS)
        scheduler_output = self.scheduler.schedule()
        grammar = scheduler_output.grammar
        self.last_step_idle = scheduler_output.total_num_scheduled_tokens == 0
        executor: PipelinedModelExecutor = self.model_executor  # type: ignore[assignment]
        if self.async_scheduling and not self.last_step_idle:
            executor.submit(scheduler_output)
            outputs += self._finish_in_flight()
            if grammar is not None:  # the tokens it follows are applied now
                self._fill_bitmask(grammar, scheduler_output)
            self._in_flight = scheduler_output
            return outputs
        outputs += self._finish_in_flight()
        if self.last_step_idle and self.structured_outputs is not None and self.structured_outputs.pending:
            self.structured_outputs.wait(GRAMMAR_IDLE_WAIT_S)
        # An empty schedule still runs the executor: it polls the KV connector's worker side,
        # which is how loads land and held blocks get released while nothing computes.
        if grammar is None:
            runner_output = self.model_executor.execute_model(scheduler_output)
        elif self._pipelined:
            executor.submit(scheduler_output)
            self._fill_bitmask(grammar, scheduler_output)
            runner_output = executor.receive()
        else:
            if self._bitmask_filler is None:
                self._bitmask_filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
            self._bitmask_filler.submit(self._fill_bitmask, grammar, scheduler_output)
            runner_output = self.model_executor.execute_model(scheduler_output)
        return outputs + self._apply(scheduler_output, runner_output)

    def _apply(
        self, scheduler_output: SchedulerOutput[Request], runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        if runner_output.compute_threads is not None:
            self._compute_threads = runner_output.compute_threads
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _fill_bitmask(self, grammar: StepGrammar, scheduler_output: SchedulerOutput[Request]) -> None:
        assert self.structured_outputs is not None
        started = time.perf_counter()
        try:
            grammars = [scheduler_output.requests[row].structured_output for row in grammar.rows]
            bitmask = self.structured_outputs.fill_bitmask(grammars)  # type: ignore[arg-type]
        except BaseException as error:
            grammar.set_error(error)
            raise
        self._bitmask_seconds.append(time.perf_counter() - started)
        grammar.set_bitmask(bitmask)

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Take the output of the step in flight (async scheduling), if any, and apply it."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        executor: PipelinedModelExecutor = self.model_executor  # type: ignore[assignment]
        return self._apply(in_flight, executor.receive())

    def close(self) -> None:
        self.model_executor.close()
        if self.structured_outputs is not None:
            self.structured_outputs.close()
        if self._bitmask_filler is not None:
            self._bitmask_filler.shutdown(wait=False)

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.compute_threads = self._compute_threads
        manager = self.structured_outputs
        if manager is not None:
            stats.num_waiting_for_grammar = manager.num_waiting
            stats.grammar_compile_failures = manager.num_compile_failures
            stats.grammar_compile_seconds, manager.compile_seconds = manager.compile_seconds, []
            stats.grammar_bitmask_seconds, self._bitmask_seconds = self._bitmask_seconds, []
        return stats

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now (KV-event snapshots, /debug/cached_blocks)."""
        return self.scheduler.kv_cache_manager.cached_block_hashes()

    def record_cache_events(self) -> None:
        self.scheduler.kv_cache_manager.record_cache_events()

    def take_cache_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) prefix-cache hashes since the last call, once recording started."""
        return self.scheduler.kv_cache_manager.take_cache_events()

    def take_tier_events(self, snapshot: bool) -> list[TierEvents]:
        """What entered and left each KV tier since the last call (every held hash too when ``snapshot``)."""
        return self.scheduler.connector.take_tier_events(snapshot)
