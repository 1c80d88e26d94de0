"""The in-process executor (``--distributed-executor-backend uni``): the model runner in the engine core's
own process, and its KV connectors' worker side next to it (the transfer agent, the tiers' worker), over the
runner's KV cache."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kvtransfer.agent import TransferAgent
from pdserve.kvtransfer.base import KVConnectorWorker
from pdserve.kvtransfer.workers import make_connector_workers
from pdserve.worker.executors import LoadedExecutor
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.process import WorkerSpec


def start_in_process(spec: WorkerSpec, runner_cls: type[ModelRunner] | None = None) -> LoadedExecutor:
    agents: list[TransferAgent] = []

    def make_workers(kv_cache: torch.Tensor) -> KVConnectorWorker:
        # The agent registers the KV cache and the block generations with its transport, so both exist
        # before the scheduler's block pool, which is then built on them.
        workers, agent = make_connector_workers(
            spec.kv_transfer, spec.kv_tiers, kv_cache, _new_generations, spec.compat_hash, spec.kv_head_ranges
        )
        if agent is not None:
            agents.append(agent)
        return workers

    has_connector = spec.kv_transfer is not None or spec.kv_tiers is not None
    runner = (runner_cls or ModelRunner)(spec.model_config, spec.runner, make_workers if has_connector else None)
    loaded = LoadedExecutor(runner, runner.cache_size, runner.describe(), startup_phases=runner.startup.phases)
    if agents:
        loaded.generations, loaded.agent_ports = agents[0].generations, [agents[0].port]
    return loaded


def _new_generations(rows: int) -> np.ndarray:
    """A block generation array private to this process (the core's pool and its one agent share it)."""
    return np.zeros(rows, dtype=np.int64)
