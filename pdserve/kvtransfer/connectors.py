"""The KV connectors an engine core can run (``--kv-connector``): one row per implementation, name ->
its scheduler-side class (``pdserve.api.registry`` rows: the table imports nothing, so the settings and the
CLI read the names without the transfer stack).

A connector class is built with the keywords of :class:`ConnectorContext` (what the loaded executor and
the engine's settings give every connector) and implements ``kvtransfer.base.KVConnectorScheduler``; its
worker side, if it has one, is the transfer agent the executor started. Adding a connector is one module
plus one row here.
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

KV_CONNECTORS = {
    "pd": "pdserve.kvtransfer.connector:PDConnectorScheduler",  # prefill holds blocks, decode pulls them
}


@dataclass
class ConnectorContext:
    config: KVTransferConfig
    compat_hash: str  # what must match for another engine's blocks to be valid here (params.kv_compat_hash)
    block_size: int
    advertised_ports: list[int]  # each rank's transfer agent's side channel, rank order
    block_generations: np.ndarray  # the cache rows' generations, shared with the transfer agents
    state_rows: int = 0  # hybrid models: the cache rows of one state slot, which follow a request's blocks


def make_connector(name: str, context: ConnectorContext) -> KVConnectorScheduler:
    connector_cls: type[KVConnectorScheduler] = resolve(KV_CONNECTORS, name, "KV connector")
    return connector_cls(**{item.name: getattr(context, item.name) for item in dataclasses.fields(context)})
