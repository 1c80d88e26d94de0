"""Transport: the data plane that fills a decode rank's blocks from a prefill rank's memory, one
:class:`~pdserve.kvtransfer.pulls.Pull` at a time, and what every transport shares: the rank's cache
seen as blocks of bytes (``read_local``, ``write_local``, of some KV heads only under tensor
parallelism), the pulls in flight, their deadlines and cancelling.

Each transport is a module of this package and a row of ``registry.TRANSPORTS``; every one is built
from the same arguments (``registry.make_transport``). A transport only moves bytes: the pulls' states
are the decode side's (``pulls``), which reads what a transport reports (``progress``, ``expire``,
``drained``). It runs only in the transfer agent's thread.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zmq

from pdserve.kvtransfer import messages
from pdserve.kvtransfer.transport.cache_layout import CacheLayout

if TYPE_CHECKING:  # pulls builds on transports; a transport only reads and marks the pulls it is given
    from pdserve.kvtransfer.pulls import Pull

logger = logging.getLogger(__name__)


class Transport(ABC):
    name: str  # its row in registry.TRANSPORTS, and what handshakes compare

    def __init__(
        self,
        kv_cache: torch.Tensor,
        generations: np.ndarray,
        seal: messages.Seal,
        rank: int = 0,
        ranks: int = 1,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """A transport over one rank's ``kv_cache`` and the engine's block ``generations``, sending as the
        agent ``seal`` seals for; ``rank`` of ``ranks``: this agent's place in its engine (which a release
        names); ``heads``: the KV heads [start, end) the rank's cache holds (None: every head)."""
        self.num_blocks = kv_cache.shape[0]
        whole = (0, kv_cache.shape[3]) if kv_cache.dim() == 6 else (0, 0)
        self.layout = CacheLayout.of(kv_cache, heads or whole)
        self.block_bytes = self.layout.block_bytes
        self.rank = rank
        self.ranks = ranks
        self.kv_cache = kv_cache
        self.generations = generations
        self.seal = seal
        self._blocks = kv_cache.view(torch.uint8).view(self.num_blocks, self.block_bytes)
        self._pulls: list[Pull] = []

    @property
    def busy(self) -> bool:
        return bool(self._pulls)

    def pulls_on(self, connection: object) -> bool:
        """Whether any pull is in flight on this connection."""
        return any(pull.connection is connection for pull in self._pulls)

    def discard(self, pull: Pull) -> bool:
        """Stop tracking a pull that is reported elsewhere (it failed to start); True if a write into
        its blocks may still land (see ``drained``)."""
        if pull in self._pulls:
            self._pulls.remove(pull)
            return self._cancel(pull)
        return False

    def local_info(self) -> dict[str, Any]:
        """What a peer needs, besides the handshake's common fields, to pull from this engine."""
        return {}

    def add_peer(self, address: tuple[str, int], reply: messages.HandshakeReply) -> None:
        return None

    def forget_peer(self, address: tuple[str, int]) -> None:
        return None

    @abstractmethod
    def start_pull(self, pull: Pull, socket: zmq.Socket[bytes], receiver: str) -> None:
        """Start the transfer (``socket`` is the peer's side channel, ``receiver`` its agent's id)."""

    @abstractmethod
    def progress(self, now: float) -> list[tuple[Pull, str | None]]:
        """Pulls that ended since the last call, with an error message for the failed ones."""

    def expire(self, now: float) -> list[tuple[Pull, bool]]:
        """Pulls past their deadline, cancelled where the transport can, each with whether a write
        into its blocks may still land (it is then reported by ``drained`` once none can)."""
        expired = [pull for pull in self._pulls if pull.deadline <= now]
        results = []
        for pull in expired:
            self._pulls.remove(pull)
            pull.peer_failed = True
            results.append((pull, self._cancel(pull)))
        return results

    def _cancel(self, pull: Pull) -> bool:
        """Stop a pull; True if a write into its blocks may still land."""
        return False

    def drained(self) -> list[Pull]:
        """Cancelled pulls that were still writing, and now no longer can."""
        return []

    def on_blocks_reply(self, reply: messages.BlocksReply, data: memoryview | None, connection: object) -> None:
        logger.warning("side channel: unexpected block data for %s", reply.request_id)

    def poll_releases(self) -> list[tuple[str, str, int, int]]:
        """(request id, hold token, decode rank, decode ranks) for each release a peer sent through the transport."""
        return []

    def _head_view(self, block_ids: list[int], heads: tuple[int, int]) -> tuple[int, int]:
        start = heads[0] - self.layout.head_start
        self.layout.regions(heads, whole=False)  # raises unless this rank holds them all
        return start, start + heads[1] - heads[0]

    def read_local(self, block_ids: list[int], heads: tuple[int, int] | None = None) -> np.ndarray:
        """A copy of these blocks' bytes (of KV heads ``heads`` only, if given), block after block."""
        if self.layout.holds_exactly(heads):
            return self._blocks[block_ids].cpu().numpy()
        assert heads is not None
        first, end = self._head_view(block_ids, heads)
        part = self.kv_cache[block_ids][:, :, :, first:end].contiguous()
        return part.view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()

    def write_local(self, block_ids: list[int], data: memoryview, heads: tuple[int, int] | None = None) -> None:
        """Write bytes ``read_local`` made (of the same heads) into these blocks."""
        if self.layout.holds_exactly(heads):
            source = np.frombuffer(data, dtype=np.uint8).reshape(len(block_ids), self.block_bytes)
            if self.kv_cache.is_cuda:
                self._blocks[block_ids] = torch.from_numpy(source.copy()).to(self.kv_cache.device)
            else:
                self._blocks.numpy()[block_ids] = source
            return
        assert heads is not None
        first, end = self._head_view(block_ids, heads)
        shape = (len(block_ids), *self.kv_cache.shape[1:3], end - first, *self.kv_cache.shape[4:])
        part = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).view(self.kv_cache.dtype).view(shape)
        self.kv_cache[block_ids, :, :, first:end] = part.to(self.kv_cache.device)

    def close(self) -> None:
        return None
