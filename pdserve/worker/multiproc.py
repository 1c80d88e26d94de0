"""MultiprocExecutor: the EngineCore's model executor when the model runs in a worker process of its
own (``--distributed-executor-backend mp``; the in-process ``ModelRunner`` is the other executor).

Each step the core sends the workers what changed (``step.StepEncoder``) over a ZMQ PUSH socket each
and waits for rank 0's output on a PULL socket (and, in a P/D engine at TP > 1, every other rank's
transfer report, joined by ``kvtransfer.aggregate.RankReports``), checking meanwhile that the workers
are alive: a
worker that dies (killed, out of memory, an exception) makes ``execute_model`` raise
:class:`WorkerDiedError`, which ends the core, so every request in flight fails at once and the
engine exits (a pod restarts). Sockets live in a private temporary folder; the worker's spec goes
to it pickled on stdin (this process spawned it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import msgspec
import numpy as np
import zmq

from pdserve.kvtransfer.aggregate import RankReports
from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.tiers.worker import CLOSE_FLUSH_SECONDS
from pdserve.worker.executors import LoadedExecutor
from pdserve.worker.interface import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.worker.kv_cache import CacheSize
from pdserve.worker.process import WorkerFailed, WorkerReady, WorkerSpec, generations_file, shared_generations
from pdserve.worker.step import RankReport, StepEncoder, decode_output, encode_bitmask, encode_shutdown

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait for the worker checks that it is alive


class WorkerDiedError(RuntimeError):
    """The worker process ended or failed: nothing it was running can finish."""


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec, startup_timeout: float = 600.0) -> None:
        """One worker process per tensor-parallel rank (``spec.runner.tp_size``); rank 0 answers."""
        size = spec.runner.tp_size
        self._folder = tempfile.mkdtemp(prefix="pdserve-worker-")
        self._context = zmq.Context()
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        outputs_address = f"ipc://{os.path.join(self._folder, 'outputs')}"
        self._outputs.bind(outputs_address)
        self._steps: list[zmq.Socket[bytes]] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self._encoder = StepEncoder()
        self._decode_report = msgspec.msgpack.Decoder(RankReport | WorkerFailed).decode
        # P/D at TP > 1: every rank's transfer agent reports, and a request's blocks change hands once all did.
        has_connector = spec.kv_transfer is not None or spec.kv_tiers is not None
        self._reports = RankReports(size) if has_connector and size > 1 else None
        # How long a worker gets to exit once told: KV tiers first write out the stores they were given.
        self._exit_seconds = 10.0 + (CLOSE_FLUSH_SECONDS if spec.kv_tiers is not None else 0.0)
        generations_path = None
        if spec.kv_transfer is not None:
            generations_path = generations_file()
            spec = replace(spec, generations_path=generations_path)
        if size > 1:
            # The ranks meet through a file in this private folder (no port to pick or to collide on).
            spec = replace(spec, distributed_init=f"file://{os.path.join(self._folder, 'distributed-init')}")
        try:
            for rank in range(size):
                steps = self._context.socket(zmq.PUSH)
                steps.setsockopt(zmq.LINGER, 0)
                steps_address = f"ipc://{os.path.join(self._folder, f'steps-{rank}')}"
                steps.bind(steps_address)
                self._steps.append(steps)
                process = subprocess.Popen(
                    [sys.executable, "-m", "pdserve.worker.process", steps_address, outputs_address, str(os.getpid())],
                    stdin=subprocess.PIPE,
                )
                self.processes.append(process)
                assert process.stdin is not None
                process.stdin.write(pickle.dumps(replace(spec, runner=replace(spec.runner, tp_rank=rank))))
                process.stdin.close()
            readies: dict[int, WorkerReady] = {}
            while len(readies) < size:
                _, payload = self._receive(startup_timeout)
                ready = msgspec.msgpack.decode(payload, type=WorkerReady | WorkerFailed)
                if isinstance(ready, WorkerFailed):
                    raise WorkerDiedError(f"a worker failed to start: {ready.message}")
                readies[ready.rank] = ready
            ready = readies[0]
            self.num_blocks = ready.num_blocks
            self.cache_size = CacheSize(ready.num_blocks, ready.num_state_slots, ready.rows_per_state_slot)
            # Each rank's transfer agent's side channel, in rank order (P/D only).
            self.agent_ports = [readies[rank].agent_port or 0 for rank in range(size)]
            self._description = ready.description
            self.startup_phases = ready.startup_phases
            # The block pool's generations: the shared-memory file every rank's agent mapped (P/D only);
            # mapped here too, then removed (the mappings outlive it).
            self.generations: np.ndarray | None = None
            if generations_path is not None:
                self.generations = shared_generations(generations_path, self.cache_size.num_rows)
        except BaseException:
            self.close()
            raise
        finally:
            if generations_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(generations_path)

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """Rank 0's process."""
        return self.processes[0]

    def describe(self) -> str:
        pids = ", ".join(str(process.pid) for process in self.processes)
        return f"{self._description}; in worker process{'es' if len(self.processes) > 1 else ''} {pids}"

    def execute_model(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.receive()

    def submit(self, scheduler_output: SchedulerOutput[ScheduledRequest]) -> None:
        """Send a step to the workers without waiting for it (they run steps in the order sent)."""
        self._broadcast(self._encoder.encode(scheduler_output))
        if scheduler_output.grammar is not None:
            # Its bitmask follows when the core has filled it; every rank samples, so every rank gets it.
            scheduler_output.grammar.on_bitmask = lambda bitmask: self._broadcast(encode_bitmask(bitmask))

    def _broadcast(self, frame: bytes) -> None:
        try:
            for steps in self._steps:
                steps.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # nobody reads: a worker is gone
            raise WorkerDiedError(self._exit_reason()) from None

    def receive(self) -> ModelRunnerOutput:
        """The output of the oldest step sent and not yet received."""
        reports = self._reports
        output: ModelRunnerOutput | None = None
        rank_outputs: list[KVConnectorOutput | None] = [None] * len(self.processes)
        for _ in range(len(self.processes) if reports is not None else 1):
            rank, answer = self._receive(None)
            if rank == 0:
                try:
                    output = decode_output(answer)
                except msgspec.ValidationError:
                    failed = msgspec.msgpack.decode(answer, type=WorkerFailed)
                    raise WorkerDiedError(f"a worker failed: {failed.message}") from None
            else:
                report = self._decode_report(answer)
                if isinstance(report, WorkerFailed):
                    raise WorkerDiedError(f"a worker failed: {report.message}")
                rank_outputs[rank] = report.kv_connector_output
        assert output is not None
        if reports is not None:
            rank_outputs[0] = output.kv_connector_output
            output.kv_connector_output = reports.join(rank_outputs)
        return output

    def _receive(self, timeout: float | None) -> tuple[int, bytes]:
        """The workers' next message and the rank that sent it; WorkerDiedError if one exits (or
        ``timeout`` passes) first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._outputs.poll(POLL_MS):
            if any(process.poll() is not None for process in self.processes):
                raise WorkerDiedError(self._exit_reason())
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"the workers were not ready within {timeout:.0f} s")
        rank, payload = self._outputs.recv_multipart()
        return int(rank), payload

    def _exit_reason(self) -> str:
        for rank, process in enumerate(self.processes):
            code = process.poll()
            if code is not None:
                return f"the worker process {process.pid} (rank {rank}) exited (code {code})"
        return "a worker hung"

    def close(self) -> None:
        for steps in self._steps:
            with contextlib.suppress(zmq.ZMQError):
                steps.send(encode_shutdown, zmq.NOBLOCK)
        for process in self.processes:
            try:
                process.wait(self._exit_seconds)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for steps in self._steps:
            steps.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)


def start_workers(spec: WorkerSpec, runner_cls: type | None = None) -> LoadedExecutor:
    """The ``mp`` row of ``worker.executors``: the model in worker processes, one per rank."""
    if runner_cls is not None:
        raise ValueError("a model runner class replaces the in-process runner: it needs the uni executor")
    executor = MultiprocExecutor(spec)
    return LoadedExecutor(
        executor,
        executor.cache_size,
        executor.describe(),
        executor.generations,
        executor.agent_ports,
        executor.startup_phases,
    )
