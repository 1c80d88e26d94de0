"""Peer reads on the scheduler side, top to bottom (docs/kv-cache.md, "Peers"). Any P/D engine can be both:

**A holder.** The router sends a decode leg with ``kv_peer_hold`` (a random handle of its own). When the request
ends by ``stop`` or ``length``, ``request_finished`` keeps its blocks whose KV was computed (prompt and answer,
whole blocks with a prefix-cache hash) and tells the transfer agent to serve them under that handle
(``served.ServedPrefixes``) for ``--kv-peer-hold-seconds``. The scheduler's ledger (``engine.remote_kv``) bounds
them by ``--kv-peer-hold-fraction`` of the cache and drops the oldest first when running requests need room
(``hold_dropped``); when the agent says a hold's time is up, the scheduler frees its blocks.

**A reader.** The router sends a prefill leg with ``kv_prefix_source``: engine, handle, how many leading prompt
tokens it holds, and the router's capability for this engine to read them. At admission,
``get_num_new_matched_tokens`` offers the whole blocks past the local prefix-cache hit up to that count (never
the last prompt token, which is computed for its logits), unless recomputing them is measured to be faster
(``tiers.cost.LoadOrRecompute``, with the peer's measured read time and this engine's forward time). The request
waits in ``WAITING_FOR_REMOTE_KVS`` while the agent reads them (``prefix_reads``); a failed read of any kind
recomputes, and the request is not offered a peer read again.

Hybrid models (state slots) take no part: their blocks carry no prefix-cache hashes.
"""

from __future__ import annotations

import time

import numpy as np

from pdserve.kvtransfer.base import ConnectorRequest, KVConnectorOutput, TierStats
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.tiers.cost import LoadOrRecompute
from pdserve.kvtransfer.work import PeerHold, PeerLoad, WorkOrders

MEDIUM = "peer"
# A capability this close to its expiry is not started on: the read would likely be refused on arrival.
CAPABILITY_MARGIN_S = 1.0


class PeerSide:
    def __init__(
        self,
        config: KVTransferConfig,
        block_size: int,
        rank_block_bytes: int,
        num_ranks: int,
        block_generations: np.ndarray,
        outbox: WorkOrders,
        state_rows: int = 0,
    ) -> None:
        self.serves = config.peer_hold_seconds > 0 and not state_rows
        self.reads = not state_rows
        self.block_size = block_size
        self.num_ranks = num_ranks
        self.generations = block_generations
        self.outbox = outbox
        self.always_read = config.peer_always_read
        self.cost = LoadOrRecompute(rank_block_bytes)
        self.stats = TierStats()
        self._offered: dict[str, int] = {}  # request id -> the local hit its offer started from
        self._loading: dict[str, int] = {}  # request id -> tokens its read brings
        self._tried: set[str] = set()  # offered a read once: never again (a failed read recomputes)

    # ----- the holder -------------------------------------------------------------------------------

    def request_finished(self, request: ConnectorRequest, block_ids: list[int], finish_reason: str) -> bool:
        """Hold a finished request's computed blocks for peers, if the router asked; True if held."""
        self._forget(request.request_id, finish_reason)
        peer = request.peer
        if not (self.serves and peer is not None and peer.hold and finish_reason in ("stop", "length")):
            return False
        num_blocks = min(len(request.block_hashes), request.num_computed_tokens // self.block_size, len(block_ids))
        if num_blocks <= 0:
            return False
        held = block_ids[:num_blocks]
        self.outbox.pending.peer_holds.append(
            PeerHold(
                request.request_id,
                peer.hold,
                list(held),
                list(request.block_hashes[:num_blocks]),
                self.generations[held].tolist(),
            )
        )
        return True

    def hold_dropped(self, request_id: str) -> None:
        """The scheduler freed a peer hold's blocks before its time was up."""
        self.outbox.pending.peer_unholds.append(request_id)

    # ----- the reader -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        request_id = request.request_id
        source = request.peer.source if request.peer is not None else None
        if source is None or not self.reads or request_id in self._tried:
            return 0, False
        size = self.block_size
        end = min(source.num_tokens, len(request.block_hashes) * size, request.num_tokens - 1) // size * size
        if end <= num_computed_tokens or source.tp_size != self.num_ranks:
            return 0, False
        if source.expires_at - CAPABILITY_MARGIN_S < time.time():
            return 0, False
        tokens = end - num_computed_tokens
        if not (self.always_read or self.cost.worth_loading({MEDIUM: tokens // size}, tokens)):
            self.stats.loads_declined += 1
            return 0, False
        self._offered[request_id] = num_computed_tokens
        return tokens, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        start = self._offered.pop(request.request_id, None)
        if start is None or not num_external_tokens:
            return
        assert request.peer is not None and request.peer.source is not None
        self._tried.add(request.request_id)
        first, last = start // self.block_size, (start + num_external_tokens) // self.block_size
        self._loading[request.request_id] = num_external_tokens
        last_hash = request.block_hashes[last - 1]
        self.outbox.pending.peer_loads.append(
            PeerLoad(request.request_id, request.peer.source, first, block_ids[first:last], last_hash)
        )

    def read_tried(self, request_id: str) -> bool:
        """Whether this request was given a peer read (its failed load is that read's)."""
        return request_id in self._tried

    def _forget(self, request_id: str, finish_reason: str) -> None:
        self._offered.pop(request_id, None)
        self._tried.discard(request_id)
        if self._loading.pop(request_id, None) is not None and finish_reason == "abort":
            self.outbox.pending.cancels.append(request_id)

    def worker_reported(self, report: KVConnectorOutput) -> None:
        for tokens, seconds in report.step_times:
            self.cost.note_step(tokens, seconds)
        for num_bytes, seconds in report.peer_loads:
            self.cost.note_load(MEDIUM, num_bytes, seconds)
            self.stats.loaded_bytes += num_bytes
            self.stats.load_seconds.append(seconds)
        for request_id in report.finished_recving & self._loading.keys():
            self.stats.hit_tokens += self._loading.pop(request_id)
        for request_id in report.failed_recving & self._loading.keys():
            blocks = self._loading.pop(request_id) // self.block_size  # not read: recomputed
            self.stats.skipped["read_failed"] = self.stats.skipped.get("read_failed", 0) + blocks

    def tier_stats(self) -> TierStats:
        stats = self.stats
        load_seconds, stats.load_seconds = stats.load_seconds, []
        return TierStats(
            hit_tokens=stats.hit_tokens,
            loaded_bytes=stats.loaded_bytes,
            skipped=dict(stats.skipped),
            loads_declined=stats.loads_declined,
            load_seconds=load_seconds,
        )
