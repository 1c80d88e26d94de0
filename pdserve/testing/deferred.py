"""DeferredExecutor: a pipelined executor in this process, for tests of async scheduling without
worker processes. Each submitted step goes through the worker's own step encoding (``step``), so the
executor sees requests as a worker does (its own token lists, the tokens it samples appended by
itself), and runs only when its output is asked for: the core schedules step N+1 before step N has
run, exactly as it does with a worker process. The KV connector's work order travels beside the
encoded step (a fake connector's need not be encodable).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from pdserve.worker.interface import ModelExecutor, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.worker.step import StepDecoder, StepEncoder, encode_bitmask


class DeferredExecutor:
    def __init__(self, runner: ModelExecutor) -> None:
        self.runner = runner
        self._encoder = StepEncoder()
        self._decoder = StepDecoder()
        self._pending: deque[tuple[bytes, Any, list[bytes]]] = deque()

    def submit(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> None:
        metadata = scheduler_output.kv_connector_metadata
        frame = self._encoder.encode(replace(scheduler_output, kv_connector_metadata=None))
        bitmask_frames: list[bytes] = []  # the grammar bitmask the core sends later, as a worker gets it
        if scheduler_output.grammar is not None:
            scheduler_output.grammar.on_bitmask = lambda bitmask: bitmask_frames.append(encode_bitmask(bitmask))
        self._pending.append((frame, metadata, bitmask_frames))

    def receive(self) -> ModelRunnerOutput:
        frame, metadata, bitmask_frames = self._pending.popleft()
        work = self._decoder.decode(frame, lambda: bitmask_frames.pop(0))
        assert work is not None
        work.kv_connector_metadata = metadata
        output = self.runner.execute_model(work)
        self._decoder.sampled(work, output.sampled_token_ids)
        return output

    def execute_model(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.receive()

    def close(self) -> None:
        self.runner.close()
