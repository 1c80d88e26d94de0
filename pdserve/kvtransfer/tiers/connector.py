"""The tier connector's scheduler side (``--kv-connector tiers``, or composed with P/D): decides what the KV
tiers below the engine's pool store, load, evict and forget, and keeps their indexes (``tiers.index``);
``tiers.worker`` moves the bytes.

- Store: the disk and shared tiers take every block as soon as it is full and hashed (``blocks_cached``;
  written through, so a restart or another engine finds it); the host tier takes blocks the pool evicts
  (``blocks_evicted``; written back, so only blocks that leave the pool cross to host memory). A store
  counts once the worker side confirms it; a tier at its bound evicts its least recently used blocks first.
- Load: a waiting request's prompt blocks past its pool hit are looked up tier by tier (host, disk, shared;
  each block from the fastest that has it) while they are found; if loading them beats recomputing them
  (``tiers.cost``) they load asynchronously and the request waits in WAITING_FOR_REMOTE_KVS. A block that
  fails its checks fails the load: the request recomputes, the block is forgotten and its file removed.
- Age: blocks unused for ``--kv-tier-max-age`` are removed (checked every ``SWEEP_INTERVAL_S``).

A shared folder also holds other engines' blocks: a lookup that misses the index checks the folder, and the
folder is rescanned every ``SHARED_RESCAN_S``. Tiers need the prefix cache's block hashes: an engine without
prefix caching (hybrid models) cannot keep tiers (``engine.build`` refuses them).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdserve.api.kv_events import TierEvents
from pdserve.kvtransfer.base import ConnectorRequest, KVConnectorOutput, KVConnectorScheduler, TierStats
from pdserve.kvtransfer.connectors import ConnectorContext
from pdserve.kvtransfer.tiers.block_file import BlockFolder
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.kvtransfer.tiers.cost import LoadOrRecompute
from pdserve.kvtransfer.tiers.index import TierIndex
from pdserve.kvtransfer.work import TierLoad, TierStore, TransferWork

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 60.0
SHARED_RESCAN_S = 300.0
PARTIAL_GRACE_S = 600.0
MAX_REFUSED = 100_000  # shared blocks remembered as refused (oldest forgotten first)
LOOKUP_ORDER = ("host", "disk", "shared")


class TierConnector(KVConnectorScheduler):
    wants_cached_blocks = True

    def __init__(
        self, tiers: KVTierConfig, compat_hash: str, block_size: int, block_bytes: int, num_ranks: int = 1
    ) -> None:
        """``block_bytes``: one block's bytes over every rank (``num_ranks`` of them)."""
        self.compat_hash = compat_hash
        # The worker side reports every load it was given; past this the scheduler's watchdog fails a load (a hung
        # read of a slow shared volume: the request computes), and its blocks wait in quarantine for the report.
        self.load_report_timeout = tiers.load_timeout_s
        self.quarantine_alarm_seconds = 2 * tiers.load_timeout_s
        self.block_size = block_size
        self.num_ranks = num_ranks
        self.tiers: dict[str, TierIndex] = {}
        self.folders: dict[str, BlockFolder] = {}
        self.write_through: list[str] = []
        if tiers.host_bytes:
            self.tiers["host"] = TierIndex("host", tiers.host_bytes // block_bytes, block_bytes, tiers.max_age_s, True)
            self.wants_evicted_blocks = True
        for medium, path, size in (
            ("disk", tiers.disk_path, tiers.disk_bytes),
            ("shared", tiers.shared_path, tiers.shared_bytes),
        ):
            if path is None:
                continue
            self.tiers[medium] = TierIndex(medium, size // block_bytes, block_bytes, tiers.max_age_s)
            self.folders[medium] = BlockFolder(path, compat_hash, 0, num_ranks)
            if not (medium == "shared" and tiers.shared_read_only):
                self.write_through.append(medium)
        self.outbox = TransferWork()
        self.always_load = tiers.always_load
        self.cost = LoadOrRecompute(block_bytes // num_ranks)
        self._planned: dict[str, list[tuple[int, str, bytes]]] = {}  # request id -> (block index, medium, hash)
        self._loading: dict[str, list[tuple[str, bytes]]] = {}  # request id -> (medium, hash) of its load
        self._abandoned: set[str] = set()  # loads still unreported that no request waits for
        self._refused_shared: dict[bytes, float] = {}  # shared blocks whose files failed a load -> when
        self._logged_reasons: set[str] = set()
        now = time.time()
        for medium in self.folders:
            self._scan(medium, now)
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        self._next_rescan = time.monotonic() + SHARED_RESCAN_S

    @classmethod
    def from_context(cls, context: ConnectorContext) -> TierConnector:
        if context.tiers is None:
            raise ValueError("the tier connector needs a tier (--kv-tier-host-bytes, --kv-tier-disk, --kv-tier-shared)")
        return cls(context.tiers, context.compat_hash, context.block_size, context.block_bytes, context.num_ranks)

    # ----- the load side ----------------------------------------------------------------------------

    def _find(self, block_hash: bytes) -> str | None:
        for medium in LOOKUP_ORDER:
            index = self.tiers.get(medium)
            if index is None:
                continue
            if block_hash in index:
                return medium
            # Another engine's store in the shared folder: known from now on (room made as for a store), unless
            # its file failed a load here and has not been written again since.
            if medium == "shared" and self.folders["shared"].exists(block_hash) and not self._refused(block_hash):
                evicted = index.adopt(block_hash, time.time())
                if evicted is not None:
                    self._delete(medium, evicted)
                    return medium
        return None

    def _refused(self, block_hash: bytes) -> bool:
        refused_at = self._refused_shared.get(block_hash)
        if refused_at is None:
            return False
        try:
            rewritten = self.folders["shared"].path(block_hash).stat().st_mtime > refused_at
        except OSError:
            rewritten = False
        if rewritten:
            del self._refused_shared[block_hash]
        return not rewritten

    def _delete(self, medium: str, hashes: list[bytes]) -> None:
        """Remove the files of blocks the tier no longer keeps (never from a read-only folder)."""
        if medium in self.write_through:
            self.outbox.tier_deletes.extend((medium, block_hash) for block_hash in hashes)

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._loading:
            # Looked up again while its load is unreported: the scheduler's watchdog gave up on it (a hung read).
            # Cancelled if it has not started; the request computes this time, since a second load under its id
            # could not be told apart from the first when that one's report comes in.
            self._abandon(request.request_id)
            return 0, False
        hashes = request.block_hashes
        plan: list[tuple[int, str, bytes]] = []
        for position in range(num_computed_tokens // self.block_size, len(hashes)):
            medium = self._find(hashes[position])
            if medium is None:
                break
            plan.append((position, medium, hashes[position]))
        self._planned.pop(request.request_id, None)
        if not plan:
            return 0, False
        by_medium: dict[str, int] = {}
        for _, medium, _ in plan:
            by_medium[medium] = by_medium.get(medium, 0) + 1
        tokens = len(plan) * self.block_size
        if not (self.always_load or self.cost.worth_loading(by_medium, tokens)):
            for medium in by_medium:
                self.tiers[medium].stats.loads_declined += 1
            return 0, False
        self._planned[request.request_id] = plan
        return tokens, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        plan = self._planned.pop(request.request_id, None)
        if plan is None or num_external_tokens == 0:
            return
        now = time.time()
        blocks = []
        for position, medium, block_hash in plan:
            index = self.tiers[medium]
            index.use(block_hash, now)
            slot = index.slot_of[block_hash] if index.slot_of is not None else -1
            blocks.append((block_ids[position], medium, block_hash, slot))
        self._loading[request.request_id] = [(medium, block_hash) for _, medium, block_hash in plan]
        self.outbox.tier_loads.append(TierLoad(request.request_id, blocks))

    def recompute_failed_load(self, request: ConnectorRequest) -> bool:
        return True  # a tier is a cache: whatever it fails to give is computed

    def _abandon(self, request_id: str) -> None:
        if request_id not in self._abandoned:
            self._abandoned.add(request_id)
            self.outbox.tier_cancels.append(request_id)

    # ----- the store side ---------------------------------------------------------------------------

    def blocks_cached(self, blocks: list[tuple[int, bytes]]) -> None:
        if not self.write_through:
            return
        stores = self.outbox.tier_stores
        for block_id, block_hash in blocks:
            media = []
            for medium in self.write_through:
                room = self.tiers[medium].reserve(block_hash)
                if room is None:
                    continue
                media.append(medium)
                self._delete(medium, [evicted for evicted, _ in room[1]])
            if media:
                stores.append(TierStore(block_id, block_hash, media))

    def blocks_evicted(self, blocks: list[tuple[int, bytes]]) -> None:
        host = self.tiers.get("host")
        if host is None:
            return
        for block_id, block_hash in blocks:
            room = host.reserve(block_hash)
            if room is not None:  # evicted host blocks need nothing done: their slots are simply rewritten
                self.outbox.tier_saves.append(TierStore(block_id, block_hash, ["host"], room[0]))

    # ----- what the worker side reports -------------------------------------------------------------

    def worker_reported(self, report: KVConnectorOutput) -> None:
        now = time.time()
        for medium, block_hash in report.tier_stored:
            self.tiers[medium].stored(block_hash, now)
        for medium, block_hash, reason in report.tier_store_failures:
            self.tiers[medium].store_failed(block_hash, reason)
            self._log_once(f"store:{reason}", f"a KV block store to the {medium} tier failed ({reason})")
        for medium, block_hash, reason in report.tier_load_failures:
            self.tiers[medium].drop(block_hash, reason)
            if medium == "shared":  # not found again by a lookup (its file may stay: a read-only folder)
                self._refused_shared[block_hash] = now
                if len(self._refused_shared) > MAX_REFUSED:
                    del self._refused_shared[next(iter(self._refused_shared))]
            self._delete(medium, [block_hash])  # a file that failed its checks goes (not from a read-only mount)
            self._log_once(
                f"load:{reason}", f"a KV block from the {medium} tier was not used ({reason}); it is recomputed"
            )
        for medium, num_bytes, seconds in report.tier_loads:
            stats = self.tiers[medium].stats
            stats.loaded_bytes += num_bytes
            stats.load_seconds.append(seconds)
            self.cost.note_load(medium, num_bytes, seconds)
        for tokens, seconds in report.step_times:
            self.cost.note_step(tokens, seconds)
        for request_id in (report.finished_recving | report.failed_recving) & self._loading.keys():
            served = request_id in report.finished_recving and request_id not in self._abandoned
            self._abandoned.discard(request_id)
            for medium, block_hash in self._loading.pop(request_id):
                index = self.tiers[medium]
                index.unpin(block_hash)
                if served:
                    index.stats.hit_tokens += self.block_size

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged_reasons:
            self._logged_reasons.add(key)
            logger.warning("%s (logged once; counted in pdserve_kv_tier_* metrics)", message)

    # ----- upkeep -----------------------------------------------------------------------------------

    def _scan(self, medium: str, now: float) -> None:
        """Take in the blocks a folder holds (every rank's file present): the most recently used ones the
        tier's bound holds, each aged by its file's mtime (its last use, by any engine); the rest, those past the
        maximum age, and old blocks some rank's file is missing from are removed (unless the folder is
        read-only)."""
        index, folder = self.tiers[medium], self.folders[medium]
        started = time.monotonic()
        ranks: dict[bytes, int] = {}
        newest: dict[bytes, float] = {}
        for entry in folder.scan(remove_stale=medium in self.write_through):
            ranks[entry.block_hash] = ranks.get(entry.block_hash, 0) + 1
            newest[entry.block_hash] = max(newest.get(entry.block_hash, 0.0), entry.mtime)
        found = sorted(((mtime, h) for h, mtime in newest.items() if ranks[h] == self.num_ranks), reverse=True)
        cutoff = now - index.max_age_s
        room = index.capacity_blocks - len(index.pending)
        kept = [(mtime, h) for mtime, h in found if mtime >= cutoff][:room]
        keep = {h for _, h in kept}
        dropped = [h for _, h in found if h not in keep and h not in index.pinned]
        # Blocks some rank's file is missing from, well after any store of theirs could still be under way: a store
        # that failed or was cut short on another rank. Never adopted; removed.
        partial = [h for h, mtime in newest.items() if ranks[h] < self.num_ranks and mtime < now - PARTIAL_GRACE_S]
        for block_hash in dropped:
            index.drop(block_hash)
        self._delete(medium, dropped + partial)
        for mtime, block_hash in reversed(kept):  # oldest first: the LRU order
            if block_hash in index:
                index.refresh(block_hash, mtime)
            else:
                index.adopt(block_hash, mtime)
        # Blocks the index held whose files are gone (removed by another engine sharing the folder).
        for block_hash in [h for h in index.last_used if h not in newest and h not in index.pinned]:
            index.drop(block_hash)
        logger.info(
            "KV %s tier at %s: %d blocks kept, %d past their age or the bound removed (%.2f s)",
            medium,
            folder.root,
            len(kept),
            len(dropped),
            time.monotonic() - started,
        )

    def _upkeep(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            wall = time.time()
            for medium, index in self.tiers.items():
                expired = [block_hash for block_hash, _ in index.expire(wall)]
                if medium == "shared":
                    expired = self._still_used_elsewhere(expired, wall - index.max_age_s)
                self._delete(medium, expired)
        if "shared" in self.folders and now >= self._next_rescan:
            self._next_rescan = now + SHARED_RESCAN_S
            self._scan("shared", time.time())

    def _still_used_elsewhere(self, expired: list[bytes], cutoff: float) -> list[bytes]:
        """Of shared blocks this engine has not used within the maximum age, those no other engine has either
        (their files' mtimes); the others are taken back in."""
        folder, index = self.folders["shared"], self.tiers["shared"]
        gone = []
        for block_hash in expired:
            try:
                mtime = folder.path(block_hash).stat().st_mtime
            except OSError:
                mtime = 0.0  # removed already: the delete finds nothing
            evicted = index.adopt(block_hash, mtime) if mtime >= cutoff else None
            if evicted is None:
                gone.append(block_hash)
            else:
                self._delete("shared", evicted)
        return gone

    def has_pending_work(self) -> bool:
        # A due sweep (or shared rescan) needs a step too: an idle engine still removes blocks past their age; and
        # so do stores not yet confirmed (the worker side's reports are taken in steps).
        now = time.monotonic()
        return (
            bool(self.outbox)
            or any(index.pending for index in self.tiers.values())
            or now >= self._next_sweep
            or ("shared" in self.folders and now >= self._next_rescan)
        )

    def note_step(self, num_tokens: int) -> None:
        self.outbox.step_tokens = num_tokens

    def build_connector_meta(self) -> TransferWork | None:
        self._upkeep()
        work, self.outbox = self.outbox, TransferWork()
        return work if work or work.step_tokens else None

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], finish_reason: str
    ) -> tuple[bool, dict[str, Any] | None]:
        self._planned.pop(request.request_id, None)
        if request.request_id in self._loading:  # finished mid-load (an abort): its load is not wanted any more
            self._abandon(request.request_id)
        return False, None

    # ----- observation ------------------------------------------------------------------------------

    def tier_stats(self) -> dict[str, TierStats]:
        return {medium: index.take_stats() for medium, index in self.tiers.items()}

    def take_tier_events(self, snapshot: bool) -> list[TierEvents]:
        return [index.take_events(snapshot) for index in self.tiers.values()]
