"""Async scheduling with the model in a worker process: the core schedules step N+1 while the worker
runs step N, and every output equals synchronous scheduling's, token for token: greedy and seeded
sampling, length caps, stop tokens and stop strings found a step late, preemption (a small cache),
prefix-cache hits, and requests aborted while a step of theirs is in flight (nothing leaks). The
whole matrix runs in make test-slow; the default suite keeps stop strings and aborts in flight, and
the scheduler state machine (tests/engine) runs in both modes."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.build import build_engine_core
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM
from pdserve.models.demo import ensure_demo_model

pytestmark = pytest.mark.timeout(600)

# Small batches and cache: prompts are chunked and requests preempted.
SETTINGS = dict(device="cpu", max_model_len=256, kv_cache_memory=1 << 20, block_size=8, max_num_batched_tokens=48)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(10, 1000) for _ in range(40)]
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randrange(5, 120))] for _ in range(10)]
    return prompts + [shared + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 20))] for _ in range(4)]


def _generate(async_scheduling: bool, params: list[SamplingParams]) -> tuple[list[list[int]], list[str], int]:
    with LLM(
        str(ensure_demo_model()), distributed_executor_backend="mp", async_scheduling=async_scheduling, **SETTINGS
    ) as llm:
        outputs = []
        for _ in range(2):  # the second round hits the prefix cache
            outputs += llm.generate(_prompts(), params)
        preemptions = llm.engine.make_stats().num_preemptions
        assert not llm.engine.has_work() and llm.engine.scheduler.kv_cache_manager.usage == 0
    return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].finish_reason for o in outputs], preemptions


@pytest.mark.slow  # eight engines with worker processes, two rounds each: about a minute
def test_async_scheduling_outputs_equal_synchronous_ones():
    rng = random.Random(7)
    greedy = [SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0) for _ in range(10)]
    seeded = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=seed) for seed in range(4)]
    expected, reasons, preemptions = _generate(False, greedy + seeded)
    # Stop tokens and strings the model really produces, found mid-stream (a step after the next one
    # was scheduled): the token of a third of the way through each greedy output.
    stops = []
    for params, tokens in zip(greedy, expected, strict=False):
        stop_token_ids = [tokens[len(tokens) // 3]] if len(tokens) > 2 else []
        stops.append(SamplingParams(max_tokens=params.max_tokens, temperature=0, stop_token_ids=stop_token_ids))
    stopped, stopped_reasons, _ = _generate(False, stops + seeded)
    assert preemptions > 0 and "stop" in stopped_reasons  # the workload exercises both

    got, got_reasons, got_preemptions = _generate(True, greedy + seeded)
    assert got == expected and got_reasons == reasons
    assert got_preemptions > 0
    assert _generate(True, stops + seeded)[:2] == (stopped, stopped_reasons)


def test_stop_strings_and_aborts_in_flight_leave_the_same_outputs_and_nothing_held():
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM(str(ensure_demo_model()), distributed_executor_backend="mp", **SETTINGS) as llm:
        whole = [o.outputs[0] for o in llm.generate(_prompts()[:6], params)]
    stop = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[out.text[len(out.text) // 2 :][:3]])
        for out in whole
    ]
    results = {}
    for async_scheduling in (False, True):
        with LLM(
            str(ensure_demo_model()), distributed_executor_backend="mp", async_scheduling=async_scheduling, **SETTINGS
        ) as llm:
            outputs = llm.generate(_prompts()[:6], stop)
            results[async_scheduling] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]
    assert results[True] == results[False] and {reason for _, reason in results[True]} == {"stop"}

    # Aborts while a step of theirs is in flight: the others' outputs are unchanged, and no block
    # stays owned once the engine has drained.
    engine, _, _ = build_engine_core(EngineArgs(model=str(ensure_demo_model()), async_scheduling=True, **SETTINGS))
    try:
        requests = [Request(f"r{i}", prompt, params) for i, prompt in enumerate(_prompts()[:6])]
        for request in requests:
            engine.add_request(request)
        for step in range(200):
            engine.step()
            if step == 6:
                engine.abort_requests(["r1", "r4"])
            if not engine.has_work():
                break
        assert not engine.has_work() and engine.scheduler.kv_cache_manager.usage == 0
        kept = [request.output_token_ids for request in requests if request.request_id not in ("r1", "r4")]
        assert kept == [out.token_ids for index, out in enumerate(whole) if index not in (1, 4)]
        assert len(requests[1].output_token_ids) < 20 and len(requests[4].output_token_ids) < 20
    finally:
        engine.close()
