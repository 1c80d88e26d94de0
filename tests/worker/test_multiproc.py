"""The multiprocess executor: the model in a worker process of its own (``distributed_executor_backend="mp"``).

Its outputs equal the in-process executor's token for token (greedy, seeded sampling, penalties, logprobs and
prompt logprobs, chunked prefill, prefix-cache hits, preemption); the step messages carry only what changed and
rebuild each request exactly; a worker that dies makes the next step fail at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import msgspec
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import free_port
from pdserve.llm import LLM
from pdserve.models.demo import ensure_demo_model
from pdserve.testing.metrics import scrape
from pdserve.testing.processes import Process, cpu_engine_flags, engine_argv, server_env
from pdserve.worker.interface import SchedulerOutput
from pdserve.worker.multiproc import WorkerDiedError
from pdserve.worker.step import Step, StepDecoder, StepEncoder, WorkerSampling
from tests.pd.cluster import post

PROMPTS = [
    "The quick brown fox",
    "word " * 150,  # chunked: longer than the batch budget below
    "The quick brown fox jumps over",  # shares a prefix with the first: a prefix-cache hit
    [5, 6, 7, 8, 9] * 7,
]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12, frequency_penalty=0.4, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11, max_tokens=9, n=2),
    ]


def _outputs(llm: LLM) -> list:
    results = llm.generate(PROMPTS, _params())
    return [
        [(c.token_ids, [sorted(e.items()) for e in c.logprobs or []], c.finish_reason) for c in result.outputs]
        + [[sorted(e.items()) if e else None for e in result.prompt_logprobs or []]]
        for result in results
    ]


@pytest.fixture(scope="module")
def model() -> str:
    return str(ensure_demo_model())


def test_the_worker_process_computes_what_the_core_process_computes(model):
    # A small KV cache and batch budget: the long prompt is chunked and requests get preempted.
    settings = dict(kv_cache_memory=2 << 20, max_model_len=512, max_num_batched_tokens=128, device="cpu")
    with LLM(model, **settings) as local:
        expected = [_outputs(local), _outputs(local)]  # the second run hits the prefix cache
        preemptions = local.engine.make_stats().num_preemptions
    with LLM(model, distributed_executor_backend="mp", **settings) as remote:
        assert [_outputs(remote), _outputs(remote)] == expected
        assert remote.engine.make_stats().num_preemptions == preemptions > 0


class _Request:
    """A stand-in for the engine's Request (the ScheduledRequest protocol)."""

    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.sampling_params = WorkerSampling(0.0, 1.0, 0, 0.0, None, 0.0, 0.0, 1.0, None, None, True)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def _step(requests, tables, scheduled, preempted=(), finished=(), starts=None) -> SchedulerOutput:
    """A step computing each request's last ``scheduled`` tokens (or from ``starts``)."""
    return SchedulerOutput(
        requests,
        scheduled,
        starts or [request.num_tokens - count for request, count in zip(requests, scheduled, strict=True)],
        tables,
        sum(scheduled),
        set(preempted),
        set(finished),
    )


def test_steps_carry_only_what_changed_and_rebuild_each_request():
    encoder, decoder = StepEncoder(), StepDecoder()
    a, b = _Request("a", [1, 2, 3, 4, 5]), _Request("b", [9, 8])
    frame = encoder.encode(_step([a, b], [[0, 1], [2]], [5, 2]))
    work = decoder.decode(frame)
    assert [r.all_token_ids for r in work.requests] == [[1, 2, 3, 4, 5], [9, 8]]
    assert work.block_ids == [[0, 1], [2]] and work.start_positions == [0, 0]
    decoder.sampled(work, [6, 7])  # the worker appends what it sampled; the core learns it from the output
    a.all_token_ids.append(6)
    b.all_token_ids.append(7)
    # A decode step: one new block for a; neither the prompts nor the sampled tokens travel.
    frame = encoder.encode(_step([a, b], [[0, 1, 3], [2]], [1, 1]))
    assert b"\x01\x02\x03\x04\x05" not in frame
    assert msgspec.msgpack.decode(frame, type=Step).new_token_ids == [[], []]
    work = decoder.decode(frame)
    assert [r.all_token_ids for r in work.requests] == [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    assert work.block_ids == [[0, 1, 3], [2]] and work.start_positions == [5, 2]
    decoder.sampled(work, [8, 4])
    # Async scheduling: the next step goes out before the core has those tokens; the worker has them.
    work = decoder.decode(encoder.encode(_step([a], [[0, 1, 3]], [1], starts=[6])))
    assert work.requests[0].all_token_ids == [1, 2, 3, 4, 5, 6, 8] and work.start_positions == [6]
    a.all_token_ids.append(8)
    b.all_token_ids.append(4)
    # b preempted (its blocks freed) and a finished: a comes no more, b comes back whole.
    frame = encoder.encode(_step([b], [[5]], [4], preempted=["b"], finished=["a"]))
    work = decoder.decode(frame)
    assert set(decoder.requests) == {"b"}
    assert work.requests[0].all_token_ids == [9, 8, 7, 4] and work.block_ids == [[5]]
    assert work.requests[0].prompt_token_ids == [9, 8] and work.requests[0].output_token_ids == [7, 4]


def test_a_worker_that_dies_fails_the_next_step_at_once(model):
    llm = LLM(model, distributed_executor_backend="mp", kv_cache_memory=2 << 20, max_model_len=256, device="cpu")
    try:
        worker = llm.engine.model_executor.process
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"{worker.pid} \(rank 0\) exited"):
            llm.generate("hello", SamplingParams(max_tokens=2))
        assert time.monotonic() - started < 2
    finally:
        llm.close()


def _descendants(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            for child in handle.read().split():
                found += [int(child), *_descendants(int(child))]
    return found


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read()


def test_an_engine_whose_worker_dies_fails_its_requests_and_exits(tmp_path, model):
    # As a pod runs it: the in-flight request gets a 503 at once, /health fails, the process exits non-zero so the
    # pod restarts.
    port = free_port()
    argv = engine_argv("decode", port, model, *cpu_engine_flags("8MiB"), "--distributed-executor-backend", "mp")
    engine = Process("decode", argv, server_env(), port, tmp_path / "decode.log")
    engine.start()
    try:
        engine.wait_healthy()
        worker = next(pid for pid in _descendants(engine.process.pid) if b"pdserve.worker.process" in _cmdline(pid))
        answers: list = []
        body = {"model": "demo", "prompt": "tell me a long story", "max_tokens": 480, "ignore_eos": True}
        request = threading.Thread(target=lambda: answers.append(post(f"{engine.url}/v1/completions", body, 30)))
        request.start()
        # Killed while generating: as soon as the engine runs it (a fast CPU writes 480 tokens in under a second).
        deadline = time.monotonic() + 10
        while not scrape(engine.url).get("pdserve_num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        request.join(15)
        assert answers and answers[0][0] == 503, answers
        assert time.monotonic() - killed < 10
        assert engine.process.wait(20) != 0
        assert not engine.healthy()
        assert "worker process" in engine.log() and "exited" in engine.log()
    finally:
        engine.stop()
