"""The transports by name: one row per transport, its class written ``"module:Class"`` (a
``pdserve.api.registry`` row) and imported only when one is built, so reading the names
(``config.TRANSPORTS``, the CLI's ``--kv-transfer`` choices) imports neither torch nor NIXL. A new
transport is a module of this package and a row here; which one an engine runs is
``nixl_policy.choose_transport``'s call ("nixl" means NIXL only where it is safe).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pdserve.api.registry import resolve

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pdserve.kvtransfer import messages
    from pdserve.kvtransfer.nixl_policy import TransportChoice
    from pdserve.kvtransfer.transport.base import Transport

TRANSPORTS: dict[str, str] = {
    "nixl": "pdserve.kvtransfer.transport.nixl:NixlTransport",
    "tcp": "pdserve.kvtransfer.transport.tcp:TcpTransport",
}


def transport_class(name: str) -> type[Transport]:
    """The class of transport ``name`` (a row of ``TRANSPORTS``), imported now."""
    cls: type[Transport] = resolve(TRANSPORTS, name, "kv transport")
    return cls


def make_transport(
    choice: TransportChoice,
    kv_cache: torch.Tensor,
    generations: np.ndarray,
    seal: messages.Seal,
    rank: int = 0,
    kv_head_ranges: list[tuple[int, int]] | None = None,
) -> Transport:
    """The chosen transport (``nixl_policy.choose_transport``) over one rank's cache (``kv_head_ranges``: the
    engine's, per rank)."""
    ranks = len(kv_head_ranges) if kv_head_ranges else 1
    heads = (kv_head_ranges[rank][0], kv_head_ranges[rank][1]) if kv_head_ranges else None
    os.environ.update(choice.ucx_env)  # before UCX starts: its listeners stay on the engine's KV address
    return transport_class(choice.name)(kv_cache, generations, seal, rank, ranks, heads)
