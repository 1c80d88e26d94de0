"""RankReports: what every tensor-parallel rank's transfer agent reported, joined into what the engine's
scheduler learns (one ``KVConnectorOutput`` a step).

Each rank holds the same block ids, so a request's blocks change hands only once every rank is done:

- held blocks are finished sending once every rank's hold ended;
- a load landed once it landed on every rank; it failed once it ended on every rank and failed on
  any. A failure while another rank still reads (or a failed read may still write) is reported at
  once as failed in flight (the scheduler quarantines the blocks and moves on), then as failed once
  no rank can write into them any more.

A KV tier holds a block once every rank stored its part; a failure on any rank is the block's, reported once
and at once (every rank's word on the store is still awaited, so a late success is not counted). Counters
add up, and each rank's transfers are listed (a load at TP m is m transfers). A TP-1
engine needs none of this: its one agent's reports are the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kvtransfer.base import KVConnectorOutput


@dataclass
class _Load:
    ended: set[int] = field(default_factory=set)  # ranks whose load landed or failed for good
    writing: set[int] = field(default_factory=set)  # ranks that failed while a write may still land
    failed: bool = False
    reported_in_flight: bool = False


@dataclass
class _Store:
    ranks: set[int] = field(default_factory=set)  # ranks that reported their part (stored or failed)
    failed: bool = False


class RankReports:
    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._sent: dict[str, set[int]] = {}  # request id -> ranks whose hold ended
        self._loads: dict[str, _Load] = {}
        # (medium, hash) -> the ranks that reported their part's store (stored or failed), whether any failed
        self._stored: dict[tuple[str, bytes], _Store] = {}

    def join(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's reports, one per rank (None: nothing new), as the engine's; None when nothing."""
        joined = KVConnectorOutput()
        touched: set[str] = set()
        for rank, output in enumerate(outputs):
            if output is None:
                continue
            for request_id in output.finished_sending:
                ranks = self._sent.setdefault(request_id, set())
                ranks.add(rank)
                if len(ranks) == self.num_ranks:
                    del self._sent[request_id]
                    joined.finished_sending.add(request_id)
            for request_id in output.finished_recving:
                self._loads.setdefault(request_id, _Load()).ended.add(rank)
            for request_id in output.failed_recving:
                load = self._loads.setdefault(request_id, _Load())
                load.ended.add(rank)
                load.writing.discard(rank)
                load.failed = True
            for request_id in output.failed_recving_in_flight:
                load = self._loads.setdefault(request_id, _Load())
                load.writing.add(rank)
                load.failed = True
            touched |= output.finished_recving | output.failed_recving | output.failed_recving_in_flight
            joined.transfers += output.transfers
            joined.num_failed_transfers += output.num_failed_transfers
            joined.num_expired_leases += output.num_expired_leases
            joined.num_failed_releases += output.num_failed_releases
            for reason, count in output.rejected_messages.items():
                joined.rejected_messages[reason] = joined.rejected_messages.get(reason, 0) + count
            for stored in output.tier_stored:
                self._store_reported(stored, rank, None, joined)
            for medium, block_hash, reason in output.tier_store_failures:
                self._store_reported((medium, block_hash), rank, reason, joined)
            joined.tier_load_failures += output.tier_load_failures
            joined.tier_loads += output.tier_loads
            joined.peer_loads += output.peer_loads  # each rank's share of a peer read
            joined.peer_reads_served += output.peer_reads_served
            if rank == 0:  # every rank times the same forwards
                joined.step_times += output.step_times
        for request_id in touched:
            load = self._loads[request_id]
            if len(load.ended) == self.num_ranks and not load.writing:
                del self._loads[request_id]
                (joined.failed_recving if load.failed else joined.finished_recving).add(request_id)
            elif load.failed and not load.reported_in_flight:
                load.reported_in_flight = True
                joined.failed_recving_in_flight.add(request_id)
        return joined if joined.says_anything() else None

    def _store_reported(
        self, key: tuple[str, bytes], rank: int, failure: str | None, joined: KVConnectorOutput
    ) -> None:
        """A rank's word on its part of a store: the block's first failure is reported at once (and only it),
        a success once every rank has reported and none failed."""
        store = self._stored.setdefault(key, _Store())
        store.ranks.add(rank)
        if failure is not None and not store.failed:
            store.failed = True
            joined.tier_store_failures.append((*key, failure))
        if len(store.ranks) == self.num_ranks:
            del self._stored[key]
            if not store.failed:
                joined.tier_stored.append(key)
