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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.engine.block_hash import BlockHash
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from pdserve.worker.interface import ModelExecutor, PipelinedModelExecutor, SchedulerOutput


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        model_executor: ModelExecutor | PipelinedModelExecutor,
        async_scheduling: bool = False,
    ) -> None:
        """``async_scheduling`` needs a ``PipelinedModelExecutor`` (workers in processes of their own)."""
        self.scheduler = scheduler
        self.model_executor = model_executor
        self.async_scheduling = async_scheduling
        self._in_flight: SchedulerOutput[Request] | None = None  # async: sent, output not taken yet
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
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests the caller decided are done (a stop string found in their text)."""
        self.scheduler.finish_requests(request_ids, status)

    def release_remote(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """A request carrying these params was refused before it was queued: its prefill engine
        may free the blocks they point at."""
        self.scheduler.connector.release_remote(kv_transfer_params)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        self.last_step_idle = scheduler_output.total_num_scheduled_tokens == 0
        if self.async_scheduling and not self.last_step_idle:
            executor: PipelinedModelExecutor = self.model_executor  # type: ignore[assignment]
            executor.submit(scheduler_output)
            outputs = self._finish_in_flight()
            self._in_flight = scheduler_output
            return outputs
        outputs = self._finish_in_flight()
        # An empty schedule still runs the executor: it polls the KV connector's worker side,
        # which is how loads land and held blocks get released while nothing computes.
        runner_output = self.model_executor.execute_model(scheduler_output)
        return outputs + self.scheduler.update_from_output(scheduler_output, runner_output)

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Take the output of the step in flight (async scheduling), if any, and apply it."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        executor: PipelinedModelExecutor = self.model_executor  # type: ignore[assignment]
        return self.scheduler.update_from_output(in_flight, executor.receive())

    def close(self) -> None:
        self.model_executor.close()

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now (KV-event snapshots, /debug/cached_blocks)."""
        return self.scheduler.kv_cache_manager.cached_block_hashes()

    def record_cache_events(self) -> None:
        self.scheduler.kv_cache_manager.record_cache_events()

    def take_cache_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed) prefix-cache hashes since the last call, once recording started."""
        return self.scheduler.kv_cache_manager.take_cache_events()
