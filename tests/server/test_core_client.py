"""The engine core in its own process, driven over ZMQ by the asyncio client: outputs equal the
in-process engine's, aborts free blocks, refused requests come back as errors, and a core that
dies fails everything in flight at once instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.engine_args import EngineArgs
from pdserve.server.core_client import EngineCoreClient, EngineDeadError, RequestRejectedError
from tests.server.helpers import demo_engine_args

PROMPTS = [[5, 6, 7], list(range(10, 60)), [300] * 20, [1, 2], list(range(100, 117))]


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> EngineArgs:
    return demo_engine_args(tmp_path_factory.mktemp("cache"))


async def _collect(queue) -> list:
    outputs = []
    while True:
        item = await asyncio.wait_for(queue.get(), timeout=60)
        if isinstance(item, Exception):
            raise item
        outputs.append(item)
        if item.finish_reason is not None:
            return outputs


def test_requests_aborts_and_rejections_through_the_core_process(args):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(args.model, kv_cache_memory=32 << 20, max_model_len=256, device="cpu")
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]

    async def scenario() -> None:
        client = await EngineCoreClient.start(args)
        try:
            assert client.ready.max_model_len == 256 and client.ready.num_kv_blocks > 0
            eos = llm.processor.eos_token_id
            queues = [await client.add_request(f"r{i}", p, greedy, eos) for i, p in enumerate(PROMPTS)]
            results = await asyncio.gather(*(_collect(q) for q in queues))
            assert [[t for o in outs for t in o.new_token_ids] for outs in results] == expected
            assert all(outs[-1].finish_reason == "length" for outs in results)

            long_running = await client.add_request(
                "long", [9] * 10, SamplingParams(max_tokens=200, ignore_eos=True), None
            )
            await asyncio.wait_for(long_running.get(), timeout=60)  # it is running
            await client.abort(["long"])
            rejected = await client.add_request("too-long", [1] * 300, greedy, None)
            with pytest.raises(RequestRejectedError, match="context length is 256"):
                await _collect(rejected)
            # After the abort nothing runs and no block is owned (cached free blocks count as free).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                stats = client.stats
                if stats and (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0):
                    break
            else:
                raise AssertionError(f"core still busy after the abort: {client.stats}")
        finally:
            await client.shutdown()
        assert client.process.exitcode == 0

    asyncio.run(scenario())


def test_a_dead_core_fails_requests_in_flight_at_once(args):
    async def scenario() -> None:
        client = await EngineCoreClient.start(args)
        try:
            queue = await client.add_request(
                "doomed", [3] * 20, SamplingParams(max_tokens=10_000, ignore_eos=True), None
            )
            await asyncio.wait_for(queue.get(), timeout=60)
            killed_at = time.monotonic()
            os.kill(client.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await _collect(queue)
            assert time.monotonic() - killed_at < 2.0
            assert not client.alive
            with pytest.raises(EngineDeadError):
                await client.add_request("late", [1, 2], SamplingParams(), None)
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_a_core_that_cannot_start_is_reported(tmp_path):
    async def scenario() -> None:
        with pytest.raises(EngineDeadError, match="exited during start-up"):
            await EngineCoreClient.start(EngineArgs(model=str(tmp_path / "no-model"), device="cpu"))

    asyncio.run(scenario())
