"""A worker process: one device's model runner (model, KV cache, sampler, the transfer agent's data
plane) behind two ZMQ sockets, driven step by step by the EngineCore's ``MultiprocExecutor``.

Started as ``python -m pdserve.worker.process STEPS OUTPUTS PARENT_PID`` with its ``WorkerSpec``
pickled on stdin (local, from the core that spawned it). It builds the runner, answers
:class:`WorkerReady`, then for each step message runs the step and sends the runner's output back,
until a shutdown message. It dies with its parent (the core), and any exception ends it: the core
notices at its next step and fails everything in flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import tempfile
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import zmq

from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.models.config import ModelConfig
from pdserve.worker.kv_cache import RunnerConfig
from pdserve.worker.step import StepDecoder, encode_output

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its runner (pickled to it on start)."""

    model_config: ModelConfig
    runner: RunnerConfig
    kv_transfer: KVTransferConfig | None = None  # P/D roles: the worker runs the transfer agent
    compat_hash: str = ""
    kv_head_ranges: list[tuple[int, int]] = field(default_factory=list)
    # Tensor parallelism (runner.tp_size > 1): where the ranks meet to set up their process group.
    distributed_init: str = ""


class WorkerReady(msgspec.Struct, tag="ready"):
    rank: int
    num_blocks: int
    description: str  # the runner's KV-cache summary, for the core's start-up log
    agent_port: int | None = None  # the transfer agent's side channel
    # The block generations: a file in shared memory (/dev/shm) the core's block pool maps and writes,
    # and this process's agent registers and reads.
    generations_path: str | None = None


class WorkerFailed(msgspec.Struct, tag="failed"):
    message: str


def _die_with_parent(parent_pid: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def shared_generations(num_blocks: int) -> tuple[np.ndarray, str]:
    """A zeroed generation array in a shared-memory file another process can map (``map_generations``)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handle, path = tempfile.mkstemp(prefix="pdserve-generations-", dir=folder)
    os.close(handle)
    return np.memmap(path, dtype=np.int64, mode="w+", shape=(num_blocks,)), path


def map_generations(path: str, num_blocks: int) -> np.ndarray:
    """The generation array a worker made (the mapping outlives the file's removal)."""
    return np.memmap(path, dtype=np.int64, mode="r+", shape=(num_blocks,))


def run_worker(spec: WorkerSpec, steps_address: str, outputs_address: str) -> None:
    from pdserve.kvtransfer.agent import TransferAgent
    from pdserve.worker.model_runner import ModelRunner

    size = spec.runner.tp_size
    if size > 1:
        # One rank per core share unless the environment says otherwise (OMP_NUM_THREADS).
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        backend = "nccl" if spec.runner.device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(
            backend, init_method=spec.distributed_init, rank=spec.runner.tp_rank, world_size=size
        )
    context = zmq.Context()
    steps = context.socket(zmq.PULL)
    steps.connect(steps_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_address)
    shared: list[str] = []  # generation files to remove on the way out
    try:
        make_agent = None
        kv_transfer = spec.kv_transfer
        if kv_transfer is not None:

            def make_agent(kv_cache: torch.Tensor) -> TransferAgent:
                generations, path = shared_generations(kv_cache.shape[0])
                shared.append(path)
                return TransferAgent(kv_transfer, kv_cache, generations, spec.compat_hash, spec.kv_head_ranges)

        runner = ModelRunner(spec.model_config, spec.runner, make_agent)
        agent = runner.kv_connector
        outputs.send(
            msgspec.msgpack.encode(
                WorkerReady(
                    spec.runner.tp_rank,
                    runner.num_blocks,
                    runner.describe(),
                    getattr(agent, "port", None),
                    shared[0] if shared else None,
                )
            )
        )
        decoder = StepDecoder()
        answers = spec.runner.tp_rank == 0  # every rank runs each step; rank 0's output is the one read
        while True:
            work = decoder.decode(steps.recv())
            if work is None:
                break
            output = runner.execute_model(work)
            if answers:
                outputs.send(encode_output(output))
        runner.close()
    except Exception as error:
        logger.exception("worker failed")
        with contextlib.suppress(zmq.ZMQError):
            outputs.send(msgspec.msgpack.encode(WorkerFailed(f"{type(error).__name__}: {error}")))
        raise
    finally:
        if size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for path in shared:
            with contextlib.suppress(OSError):
                os.unlink(path)
        steps.close(linger=0)
        outputs.close(linger=1000)
        context.term()


def main() -> None:
    steps_address, outputs_address, parent_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    spec = pickle.load(sys.stdin.buffer)
    run_worker(spec, steps_address, outputs_address)


if __name__ == "__main__":
    main()
