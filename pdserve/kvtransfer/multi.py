"""The multi-connector: several KV connectors as one (P/D with the KV tiers), scheduler side and worker side.

Scheduler side, hook by hook:

- a lookup (``get_num_new_matched_tokens``) asks the parts in order and the first that can load anything owns
  the request's load (P/D first: a decode leg's remote prefill covers its whole prompt; the tiers serve the
  rest); only the owner hears ``update_state_after_alloc`` with the tokens, the others with none; a failed
  load is recomputed or not as its owner says;
- the store side (``blocks_cached``, ``blocks_evicted``), ``note_step``, ``request_added``, the P/D moments
  and ``worker_reported`` go to every part; a finished request is held if any part holds it, with the params
  of the part that does;
- each step's work orders are merged into one (``TransferWork.merge``), stats and tier events joined.

Worker side: every part's worker gets the step's order (each reads its own fields) and their reports merge.
"""

from __future__ import annotations

from typing import Any

from pdserve.api.kv_events import TierEvents
from pdserve.kvtransfer.base import (
    ConnectorRequest,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    TierStats,
)
from pdserve.kvtransfer.params import RemotePrefill
from pdserve.kvtransfer.work import TransferWork


class MultiConnector(KVConnectorScheduler):
    def __init__(self, parts: list[KVConnectorScheduler]) -> None:
        if len(parts) < 2:
            raise ValueError("a multi-connector composes at least two connectors")
        self.parts = parts
        first = parts[0]
        self.compat_hash = next((part.compat_hash for part in parts if part.compat_hash), None)
        self.recompute_failed_loads = first.recompute_failed_loads
        self.max_held_fraction = first.max_held_fraction
        self.peer_hold_fraction = max(part.peer_hold_fraction for part in parts)
        timeouts = [part.load_report_timeout for part in parts if part.load_report_timeout is not None]
        self.load_report_timeout = max(timeouts) if timeouts else None
        self.quarantine_alarm_seconds = max(part.quarantine_alarm_seconds for part in parts)
        self.wants_cached_blocks = any(part.wants_cached_blocks for part in parts)
        self.wants_evicted_blocks = any(part.wants_evicted_blocks for part in parts)
        self._owner: dict[str, KVConnectorScheduler] = {}  # request id -> the part whose load it waits for

    # ----- the load side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self._owner.pop(request.request_id, None)
        for part in self.parts:
            tokens, load_async = part.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens:
                self._owner[request.request_id] = part
                return tokens, load_async
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        owner = self._owner.get(request.request_id)
        for part in self.parts:
            part.update_state_after_alloc(request, block_ids, num_external_tokens if part is owner else 0)

    def recompute_failed_load(self, request: ConnectorRequest) -> bool:
        owner = self._owner.get(request.request_id)
        return (owner or self.parts[0]).recompute_failed_load(request)

    def expects_remote_kv(self, request: ConnectorRequest) -> bool:
        return any(part.expects_remote_kv(request) for part in self.parts)

    # ----- moments every part hears -----------------------------------------------------------------

    def request_added(self, request: ConnectorRequest) -> None:
        for part in self.parts:
            part.request_added(request)

    def release_remote(self, remote: RemotePrefill | None) -> None:
        for part in self.parts:
            part.release_remote(remote)

    def hold_cancelled(self, request_id: str) -> None:
        for part in self.parts:
            part.hold_cancelled(request_id)

    def peer_hold_dropped(self, request_id: str) -> None:
        for part in self.parts:
            part.peer_hold_dropped(request_id)

    def peer_source(self) -> tuple[str, list[int], float] | None:
        return next((source for part in self.parts if (source := part.peer_source()) is not None), None)

    def hands_over(self, request: ConnectorRequest) -> bool:
        return any(part.hands_over(request) for part in self.parts)

    def blocks_cached(self, blocks: list[tuple[int, bytes]]) -> None:
        for part in self.parts:
            if part.wants_cached_blocks:
                part.blocks_cached(blocks)

    def blocks_evicted(self, blocks: list[tuple[int, bytes]]) -> None:
        for part in self.parts:
            if part.wants_evicted_blocks:
                part.blocks_evicted(blocks)

    def note_step(self, num_tokens: int) -> None:
        for part in self.parts:
            part.note_step(num_tokens)

    def worker_reported(self, report: KVConnectorOutput) -> None:
        for part in self.parts:
            part.worker_reported(report)

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], finish_reason: str
    ) -> tuple[bool, dict[str, Any] | None]:
        self._owner.pop(request.request_id, None)
        hold, params = False, None
        for part in self.parts:
            part_hold, part_params = part.request_finished(request, block_ids, finish_reason)
            if part_hold:
                hold, params = True, part_params
            elif params is None:
                params = part_params
        return hold, params

    # ----- work and observation ---------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        return any(part.has_pending_work() for part in self.parts)

    def build_connector_meta(self) -> TransferWork | None:
        merged: TransferWork | None = None
        for part in self.parts:
            work = part.build_connector_meta()
            if work is None:
                continue
            if merged is None:
                merged = work
            else:
                merged.merge(work)
        return merged

    def tier_stats(self) -> dict[str, TierStats]:
        stats: dict[str, TierStats] = {}
        for part in self.parts:
            stats.update(part.tier_stats())
        return stats

    def take_tier_events(self, snapshot: bool) -> list[TierEvents]:
        return [events for part in self.parts for events in part.take_tier_events(snapshot)]


class MultiWorker:
    """The worker sides of a multi-connector's parts, in the same order."""

    def __init__(self, parts: list[KVConnectorWorker]) -> None:
        self.parts = parts

    def submit(self, work: TransferWork) -> None:
        for part in self.parts:
            part.submit(work)

    def collect(self) -> KVConnectorOutput | None:
        joined: KVConnectorOutput | None = None
        for part in self.parts:
            output = part.collect()
            if output is None:
                continue
            if joined is None:
                joined = output
            else:
                joined.merge(output)
        return joined

    def close(self) -> None:
        for part in self.parts:
            part.close()
