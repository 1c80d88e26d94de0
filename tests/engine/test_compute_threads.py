"""The compute threads a CPU runner runs with now (its ThreadGovernor's count) reach the engine's stats and
/metrics, beside the budget it started with: the runner says it with each step's output, across the worker wire
too (async scheduling encodes outputs as a worker process does)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine.core_process import CpuShare
from pdserve.engine.stats import SchedulerStats
from pdserve.server.metrics import EngineMetrics
from tests.engine.helpers import make_engine, make_request, prompt_of


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_stats_carry_the_threads_of_the_runners_last_step(async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling, num_blocks=64, block_size=4, max_model_len=64)
    runner = engine.model_executor.runner if async_scheduling else engine.model_executor
    said = itertools.chain([2, 2, 1, 1, 1], itertools.repeat(2))  # a governor: down a while, then back
    plain = runner.execute_model

    def governed(scheduler_output):
        return dataclasses.replace(plain(scheduler_output), compute_threads=next(said))

    runner.execute_model = governed
    assert engine.make_stats().compute_threads is None  # no step yet: nothing said
    engine.add_request(make_request("r", prompt_of(6, 0), max_tokens=8, ignore_eos=True))
    seen = []
    while engine.has_work():
        engine.step()
        seen.append(engine.make_stats().compute_threads)
    assert 1 in seen and seen[-1] == 2, seen  # it followed the runner down and back up


def _values(metrics: EngineMetrics) -> dict[str, float]:
    registry: CollectorRegistry = metrics.registry
    return {sample.name: sample.value for family in registry.collect() for sample in family.samples}


def test_the_metric_is_the_runners_count_and_the_budget_stays_beside_it():
    stats = SchedulerStats(0, 0, 0, 0.0, 0, 0, 0, compute_threads=1)
    cpu = CpuShare(threads=2, reason="2 CPUs in the affinity mask", cpu_quota=0.0, memory_limit=0)
    values = _values(EngineMetrics(lambda: stats, {}, cpu))
    assert values["pdserve_cpu_compute_threads"] == 1
    assert values["pdserve_cpu_thread_budget"] == 2
    # Before the first step (or a runner that does not follow contention): the budget.
    for unsaid in (None, dataclasses.replace(stats, compute_threads=None)):
        values = _values(EngineMetrics(lambda unsaid=unsaid: unsaid, {}, cpu))
        assert values["pdserve_cpu_compute_threads"] == 2
