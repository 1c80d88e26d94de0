"""The in-process executor (``--distributed-executor-backend uni``): the model runner in the engine core's
own process, and (P/D) its transfer agent next to it, over the runner's KV cache."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kvtransfer.agent import TransferAgent, make_transfer_agent
from pdserve.worker.executors import LoadedExecutor
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.process import WorkerSpec


def start_in_process(spec: WorkerSpec, runner_cls: type[ModelRunner] | None = None) -> LoadedExecutor:
    agents: list[TransferAgent] = []

    def make_agent(kv_cache: torch.Tensor) -> TransferAgent:
        # The agent registers the KV cache and the block generations with its transport, so both exist
        # before the scheduler's block pool, which is then built on them.
        assert spec.kv_transfer is not None
        agent = make_transfer_agent(spec.kv_transfer, kv_cache, _new_generations, spec.compat_hash, spec.kv_head_ranges)
        agents.append(agent)
        return agent

    runner = (runner_cls or ModelRunner)(
        spec.model_config, spec.runner, make_agent if spec.kv_transfer is not None else None
    )
    loaded = LoadedExecutor(runner, runner.cache_size, runner.describe())
    if agents:
        loaded.generations, loaded.agent_ports = agents[0].generations, [agents[0].port]
    return loaded


def _new_generations(rows: int) -> np.ndarray:
    """A block generation array private to this process (the core's pool and its one agent share it)."""
    return np.zeros(rows, dtype=np.int64)
