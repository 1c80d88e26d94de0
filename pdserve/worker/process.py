"""A worker process: one device's model runner (model, KV cache, sampler, the transfer agent's data
plane) behind two ZMQ sockets, driven step by step by the EngineCore's ``MultiprocExecutor``.

Started as ``python -m pdserve.worker.process STEPS OUTPUTS PARENT_PID`` with its ``WorkerSpec``
pickled on stdin (local, from the core that spawned it). It builds the runner, answers
:class:`WorkerReady`, then for each step message runs the step and sends the runner's output back
(rank 0), or (other ranks of a P/D engine) what its transfer agent reported, until a shutdown
message. Every message out is two frames: the rank, then the message. It dies with its parent (the
core), and any exception ends it: the core notices at its next step and fails everything in flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
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
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.models.config import ModelConfig
from pdserve.worker.kv_cache import RunnerConfig
from pdserve.worker.step import RankReport, StepDecoder, encode_output

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its runner (pickled to it on start)."""

    model_config: ModelConfig
    runner: RunnerConfig
    kv_transfer: KVTransferConfig | None = None  # P/D roles: the worker runs the transfer agent
    kv_tiers: KVTierConfig | None = None  # KV tiers on: the worker runs the tiers' worker side
    compat_hash: str = ""
    kv_head_ranges: list[tuple[int, int]] = field(default_factory=list)
    # P/D: the block pool's generations, a file in shared memory every rank's agent maps (and reads,
    # and registers with NIXL) and the core's block pool writes (``shared_generations``).
    generations_path: str | None = None
    # Tensor parallelism (runner.tp_size > 1): where the ranks meet to set up their process group.
    distributed_init: str = ""


class WorkerReady(msgspec.Struct, tag="ready"):
    rank: int
    num_blocks: int
    description: str  # the runner's KV-cache summary, for the core's start-up log
    agent_port: int | None = None  # this rank's transfer agent's side channel
    num_state_slots: int = 0  # hybrid models: linear-attention state slots
    rows_per_state_slot: int = 0  # and the cache rows each takes after the pool's blocks
    startup_phases: list[tuple[str, float]] = []  # (name, seconds), in order (``worker.startup``)


class WorkerFailed(msgspec.Struct, tag="failed"):
    message: str


def _die_with_parent(parent_pid: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def generations_file() -> str:
    """An empty file in shared memory (/dev/shm where there is one) for a block generation array."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handle, path = tempfile.mkstemp(prefix="pdserve-generations-", dir=folder)
    os.close(handle)
    return path


def shared_generations(path: str, num_blocks: int) -> np.ndarray:
    """The generation array of ``num_blocks`` blocks in ``path``, mapped (zeros when new). Every rank
    sizes the file alike, so whichever maps first makes it; the mapping outlives the file's removal."""
    with open(path, "r+b") as file:
        if os.fstat(file.fileno()).st_size != num_blocks * 8:
            os.ftruncate(file.fileno(), num_blocks * 8)
    return np.memmap(path, dtype=np.int64, mode="r+", shape=(num_blocks,))


def _private_generations(rows: int) -> np.ndarray:
    """No transfer agent shares the generations: the tiers alone never read them."""
    return np.zeros(rows, dtype=np.int64)


def run_worker(spec: WorkerSpec, steps_address: str, outputs_address: str) -> None:
    from pdserve.kvtransfer.agent import TransferAgent
    from pdserve.kvtransfer.base import KVConnectorWorker
    from pdserve.kvtransfer.workers import make_connector_workers
    from pdserve.worker.model_runner import ModelRunner

    size = spec.runner.tp_size
    if size > 1:
        backend = "nccl" if spec.runner.device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(
            backend, init_method=spec.distributed_init, rank=spec.runner.tp_rank, world_size=size
        )
    context = zmq.Context()
    steps = context.socket(zmq.PULL)
    steps.connect(steps_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_address)
    rank = spec.runner.tp_rank
    rank_frame = str(rank).encode()
    try:
        make_workers = None
        agents: list[TransferAgent] = []
        if spec.kv_transfer is not None or spec.kv_tiers is not None:

            def make_workers(kv_cache: torch.Tensor) -> KVConnectorWorker:
                generations = (
                    functools.partial(shared_generations, spec.generations_path)
                    if spec.generations_path is not None
                    else _private_generations
                )
                workers, agent = make_connector_workers(
                    spec.kv_transfer, spec.kv_tiers, kv_cache, generations, spec.compat_hash, spec.kv_head_ranges, rank
                )
                agents.extend([agent] if agent is not None else [])
                return workers

        runner = ModelRunner(spec.model_config, spec.runner, make_workers)
        ready = WorkerReady(
            rank,
            runner.num_blocks,
            runner.describe(),
            agents[0].port if agents else None,
            runner.cache_size.num_state_slots,
            runner.cache_size.rows_per_state_slot,
            runner.startup.phases,
        )
        outputs.send_multipart([rank_frame, msgspec.msgpack.encode(ready)])
        decoder = StepDecoder()
        # Every rank runs each step; rank 0's output is the one read, and the other ranks of a P/D
        # engine add what their own transfer agents reported.
        reports = rank > 0 and runner.kv_connector is not None
        while True:
            work = decoder.decode(steps.recv(), steps.recv)
            if work is None:
                break
            output = runner.execute_model(work)
            if work.grammar is not None:
                work.grammar.bitmask()  # taken off the socket even if nothing sampled
            decoder.sampled(work, output.sampled_token_ids)
            if rank == 0:
                outputs.send_multipart([rank_frame, encode_output(output)])
            elif reports:
                outputs.send_multipart([rank_frame, encode_output(RankReport(output.kv_connector_output))])
        runner.close()
    except Exception as error:
        logger.exception("worker failed")
        with contextlib.suppress(zmq.ZMQError):
            failed = WorkerFailed(f"rank {rank}: {type(error).__name__}: {error}")
            outputs.send_multipart([rank_frame, msgspec.msgpack.encode(failed)])
        raise
    finally:
        if size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
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
