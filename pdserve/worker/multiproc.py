"""MultiprocExecutor: the EngineCore's model executor when the model runs in a worker process of its
own (``--distributed-executor-backend mp``; the in-process ``ModelRunner`` is the other executor).

Each step the core sends the worker what changed (``step.StepEncoder``) over a ZMQ PUSH socket and
waits for the runner's output on a PULL socket, checking meanwhile that the worker is alive: a
worker that dies (killed, out of memory, an exception) makes ``execute_model`` raise
:class:`WorkerDiedError`, which ends the core, so every request in flight fails at once and the
engine exits (a pod restarts). Sockets live in a private temporary folder; the worker's spec goes
to it pickled on stdin (this process spawned it).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

import msgspec
import numpy as np
import zmq

from pdserve.worker.interface import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.worker.process import WorkerFailed, WorkerReady, WorkerSpec, map_generations
from pdserve.worker.step import StepEncoder, decode_output, encode_shutdown

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait for the worker checks that it is alive


class WorkerDiedError(RuntimeError):
    """The worker process ended or failed: nothing it was running can finish."""


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec, startup_timeout: float = 600.0) -> None:
        self._folder = tempfile.mkdtemp(prefix="pdserve-worker-")
        steps_address = f"ipc://{os.path.join(self._folder, 'steps')}"
        outputs_address = f"ipc://{os.path.join(self._folder, 'outputs')}"
        self._context = zmq.Context()
        self._steps = self._context.socket(zmq.PUSH)
        self._steps.setsockopt(zmq.LINGER, 0)
        self._steps.bind(steps_address)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.bind(outputs_address)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.worker.process", steps_address, outputs_address, str(os.getpid())],
            stdin=subprocess.PIPE,
        )
        self._encoder = StepEncoder()
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(pickle.dumps(spec))
            self.process.stdin.close()
            ready = msgspec.msgpack.decode(self._receive(startup_timeout), type=WorkerReady | WorkerFailed)
            if isinstance(ready, WorkerFailed):
                raise WorkerDiedError(f"the worker failed to start: {ready.message}")
        except BaseException:
            self.close()
            raise
        self.num_blocks = ready.num_blocks
        self.agent_port = ready.agent_port
        self._description = ready.description
        # The block pool's generations: mapped from the worker's shared-memory file (P/D only).
        self.generations: np.ndarray | None = None
        if ready.generations_path is not None:
            self.generations = map_generations(ready.generations_path, ready.num_blocks)

    def describe(self) -> str:
        return f"{self._description}; in worker process {self.process.pid}"

    def execute_model(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> ModelRunnerOutput:
        try:
            self._steps.send(self._encoder.encode(scheduler_output), zmq.NOBLOCK)
        except zmq.Again:  # nobody reads: the worker is gone
            raise WorkerDiedError(self._exit_reason()) from None
        frame = self._receive(None)
        try:
            return decode_output(frame)
        except msgspec.ValidationError:
            failed = msgspec.msgpack.decode(frame, type=WorkerFailed)
            raise WorkerDiedError(f"the worker failed: {failed.message}") from None

    def _receive(self, timeout: float | None) -> bytes:
        """The worker's next message; WorkerDiedError if it exits (or ``timeout`` passes) first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._outputs.poll(POLL_MS):
            if self.process.poll() is not None:
                raise WorkerDiedError(self._exit_reason())
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"the worker was not ready within {timeout:.0f} s")
        return self._outputs.recv()

    def _exit_reason(self) -> str:
        code = self.process.poll()
        return f"the worker process {self.process.pid} exited (code {code})" if code is not None else "the worker hung"

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._steps.send(encode_shutdown, zmq.NOBLOCK)
                self.process.wait(10)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(10)
        self._steps.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)
