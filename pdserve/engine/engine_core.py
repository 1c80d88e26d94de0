"""EngineCore: one step = schedule → execute the model → update from its output.

The core owns the scheduler (and through it all KV memory state) and a model runner. It runs
wherever the caller puts it: in-process for the offline API and tests, or in its own process
behind ZMQ for the servers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pdserve.engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler, SchedulerStats


class ModelRunner(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens' KV and sample one token for each request that reached
        the end of its known tokens (NO_TOKEN for a partial prompt chunk)."""
        ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        # True when the last step computed nothing (it only waited on KV transfers): the process
        # loop then sleeps briefly instead of spinning.
        self.last_step_idle = False

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        # An empty schedule still runs the model: the runner polls the KV connector's worker
        # side, which is how loads land and held blocks get released while nothing computes.
        runner_output = self.model_runner.execute_model(scheduler_output)
        self.last_step_idle = scheduler_output.total_num_scheduled_tokens == 0
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def close(self) -> None:
        close = getattr(self.model_runner, "close", None)
        if close is not None:
            close()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()
