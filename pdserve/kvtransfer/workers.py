"""The KV connectors' worker sides of one rank, built next to its KV cache: the transfer agent (P/D roles),
the tiers' worker (when a tier is on), or both as one ``MultiWorker`` in the order the scheduler side composes
its connectors (``kvtransfer.connectors``: P/D first, then tiers); and ``TimedWorker`` around them, which
reports each forward's tokens and wall time (the connectors weigh loading blocks against recomputing them)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from pdserve.kvtransfer.agent import TransferAgent, make_transfer_agent
from pdserve.kvtransfer.base import KVConnectorOutput, KVConnectorWorker
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.multi import MultiWorker
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.kvtransfer.tiers.worker import TierWorker
from pdserve.kvtransfer.work import TransferWork


class TimedWorker:
    """A worker side that also times each forward: from the step's order (``submit``, before the forward) to its
    report (``collect``, after it), with the tokens the order says the step computes. An order with nothing to do
    but that count is not passed on."""

    def __init__(self, inner: KVConnectorWorker) -> None:
        self.inner = inner
        self._started: float | None = None
        self._tokens = 0

    def submit(self, work: TransferWork) -> None:
        self._started = time.perf_counter()
        self._tokens = work.step_tokens
        if work:
            self.inner.submit(work)

    def collect(self) -> KVConnectorOutput | None:
        output = self.inner.collect()
        if self._started is not None and self._tokens:
            output = output or KVConnectorOutput()
            output.step_times.append((self._tokens, time.perf_counter() - self._started))
        self._started = None
        return output

    def close(self) -> None:
        self.inner.close()


def make_connector_workers(
    kv_transfer: KVTransferConfig | None,
    kv_tiers: KVTierConfig | None,
    kv_cache: torch.Tensor,
    generations: Callable[[int], np.ndarray],
    compat_hash: str,
    kv_head_ranges: list[tuple[int, int]],
    rank: int = 0,
) -> tuple[KVConnectorWorker, TransferAgent | None]:
    """(the rank's connector worker side, its transfer agent if it has one); ``generations`` as for
    ``make_transfer_agent``."""
    parts: list[KVConnectorWorker] = []
    agent = None
    if kv_transfer is not None:
        agent = make_transfer_agent(kv_transfer, kv_cache, generations, compat_hash, kv_head_ranges, rank)
        parts.append(agent)
    if kv_tiers is not None:
        parts.append(TierWorker(kv_tiers, kv_cache, compat_hash, rank, max(1, len(kv_head_ranges))))
    if not parts:
        raise ValueError("no KV connector to build a worker side for")
    return TimedWorker(parts[0] if len(parts) == 1 else MultiWorker(parts)), agent
