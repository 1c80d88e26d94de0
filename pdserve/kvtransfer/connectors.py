"""The KV connectors an engine core can run (``--kv-connector``): one row per implementation, name ->
its scheduler-side class (``pdserve.api.registry`` rows: the table imports nothing, so the settings and the
CLI read the names without the transfer stack).

A connector class implements ``kvtransfer.base.KVConnectorScheduler`` and is built by its ``from_context``
from a :class:`ConnectorContext` (what the loaded executor and the engine's settings give every connector);
its worker side, if it has one, is built next to the KV cache by ``kvtransfer.workers``. An engine runs the
connectors its settings call for (a P/D role's ``--kv-connector``, then ``tiers`` when a tier is on), several
as one ``kvtransfer.multi.MultiConnector``. Adding a connector is one module plus one row here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.api.registry import resolve

if TYPE_CHECKING:
    import numpy as np

    from pdserve.kvtransfer.base import KVConnectorScheduler
    from pdserve.kvtransfer.config import KVTransferConfig
    from pdserve.kvtransfer.tiers.config import KVTierConfig

KV_CONNECTORS = {
    "pd": "pdserve.kvtransfer.connector:PDConnectorScheduler",  # prefill holds blocks, decode pulls them
    "tiers": "pdserve.kvtransfer.tiers.connector:TierConnector",  # host memory, local disk, shared folder
}


@dataclass
class ConnectorContext:
    compat_hash: str  # what must match for another engine's blocks to be valid here (params.kv_compat_hash)
    block_size: int
    block_bytes: int  # one block's bytes over every rank
    num_ranks: int
    config: KVTransferConfig | None = None  # P/D roles
    tiers: KVTierConfig | None = None  # the KV tiers, when any is on
    advertised_ports: list[int] = dataclasses.field(default_factory=list)  # each rank's transfer agent, rank order
    block_generations: np.ndarray | None = None  # the cache rows' generations, shared with the transfer agents
    state_rows: int = 0  # hybrid models: the cache rows of one state slot, which follow a request's blocks


def make_connector(names: list[str], context: ConnectorContext) -> KVConnectorScheduler:
    """The connector of these names (more than one: a multi-connector of them, in this order)."""
    parts: list[KVConnectorScheduler] = [
        resolve(KV_CONNECTORS, name, "KV connector").from_context(context) for name in names
    ]
    if len(parts) == 1:
        return parts[0]
    from pdserve.kvtransfer.multi import MultiConnector

    return MultiConnector(parts)
