"""The model executors an engine core can drive (``--distributed-executor-backend``): one row per
implementation, name -> its starter (``pdserve.api.registry`` rows: the table imports nothing, so the
settings and the CLI read the names without torch).

A starter takes the worker's spec (``worker.process.WorkerSpec``) and the in-process runner class to use
(None: ``ModelRunner``; only an in-process executor runs another), loads the model and its KV cache, and
returns a :class:`LoadedExecutor`: the executor, driven through ``worker.interface.ModelExecutor``, and
what the engine core's scheduler and KV connector are built on. Adding an executor is one module with a
starter plus one row here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from pdserve.worker.interface import ModelExecutor
    from pdserve.worker.kv_cache import CacheSize

EXECUTORS = {
    "uni": "pdserve.worker.uniproc:start_in_process",  # the model in the engine core's own process
    "mp": "pdserve.worker.multiproc:start_workers",  # one worker process per tensor-parallel rank
}


@dataclass
class LoadedExecutor:
    executor: ModelExecutor
    cache_size: CacheSize  # the pool's blocks and (hybrid models) the state slots the cache holds
    description: str  # the KV cache's summary, for the start-up log
    # P/D: the block pool's generation array, registered with the transfer agents, and each rank's side
    # channel port (rank order). None / [0] without a transfer agent.
    generations: np.ndarray | None = None
    agent_ports: list[int] = field(default_factory=lambda: [0])
    # Rank 0's start-up phases, (name, seconds) in order (``worker.startup``).
    startup_phases: list[tuple[str, float]] = field(default_factory=list)
