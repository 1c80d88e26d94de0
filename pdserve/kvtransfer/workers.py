"""The KV connectors' worker sides of one rank, built next to its KV cache: the transfer agent (P/D roles),
the tiers' worker (when a tier is on), or both as one ``MultiWorker`` in the order the scheduler side composes
its connectors (``kvtransfer.connectors``: P/D first, then tiers)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pdserve.kvtransfer.agent import TransferAgent, make_transfer_agent
from pdserve.kvtransfer.base import KVConnectorWorker
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.multi import MultiWorker
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.kvtransfer.tiers.worker import TierWorker


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
    return (parts[0] if len(parts) == 1 else MultiWorker(parts)), agent
