"""TierWorker: the KV tiers' worker side, next to one rank's KV cache: carries out the tier connector's
orders (``work.TierStore``, ``work.TierLoad``) and reports what became of them.

Within a step (``submit`` before the forward, ``collect`` after it):

- saves (host tier, write-back) copy evicted blocks to their host slots in ``submit``, before the forward
  overwrites them;
- stores (disk, shared) snapshot their blocks in ``collect``, after the forward wrote them, and an I/O thread
  writes the snapshots out; the snapshot is taken because the block may be reused before the write ends. A
  backlog over ``MAX_STORE_BACKLOG_BYTES`` drops stores (reported, counted): the engine never waits for a disk;
- loads run on the I/O thread ahead of stores and deletes: each block is read and checked
  (``block_file.BlockFolder.read_into``) straight into its KV-cache row on a CPU engine (the rows are the
  request's own and unused until the load is reported landed; a block that fails its checks fails the load,
  and the request's blocks are freed uncached), or through a staging buffer on a GPU;
- deletes go on the same queue as stores, so a delete and a later store of one block happen in order.

``close`` lets the I/O thread finish the stores and deletes it was given (for up to ``CLOSE_FLUSH_SECONDS``; what
is left then is logged and dropped): a block the engine reported stored before it stopped is on disk for the
next engine to start from. Queued loads are dropped: no request is left to use them.
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kvtransfer.base import KVConnectorOutput
from pdserve.kvtransfer.tiers.block_file import BlockFileError, BlockFolder
from pdserve.kvtransfer.tiers.config import KVTierConfig
from pdserve.kvtransfer.work import TierLoad, TransferWork

logger = logging.getLogger(__name__)

MAX_STORE_BACKLOG_BYTES = 256 << 20
CLOSE_FLUSH_SECONDS = 30.0


@dataclass(slots=True)
class _Store:
    block_hash: bytes
    media: list[str]
    payload: np.ndarray


class TierWorker:
    def __init__(self, config: KVTierConfig, kv_cache: torch.Tensor, compat_hash: str, rank: int, ranks: int) -> None:
        """Over this rank's ``kv_cache``, rank ``rank`` of ``ranks`` (every row a block: no state slots)."""
        rows = kv_cache.shape[0]
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self._blocks = kv_cache.view(torch.uint8).view(rows, self.block_bytes)
        self._on_cpu = kv_cache.device.type == "cpu"
        self.folders: dict[str, BlockFolder] = {}
        if config.disk_path is not None:
            self.folders["disk"] = BlockFolder(config.disk_path, compat_hash, rank, ranks)
        if config.shared_path is not None:
            self.folders["shared"] = BlockFolder(config.shared_path, compat_hash, rank, ranks)
        # Folders this engine may write (a read-only shared tier is never changed, not even its mtimes).
        self._touch = {medium for medium in self.folders if not (medium == "shared" and config.shared_read_only)}
        self._host: torch.Tensor | None = None
        if config.host_bytes:
            if self._on_cpu:
                raise ValueError("a host-memory KV tier on a CPU engine would copy blocks within the same memory")
            slots = config.host_bytes // (self.block_bytes * ranks)
            self._host = torch.empty((slots, self.block_bytes), dtype=torch.uint8, pin_memory=True)
        self._stores_after_forward: list[tuple[int, bytes, list[str]]] = []
        self._loads: collections.deque[TierLoad] = collections.deque()
        self._writes: collections.deque[_Store | tuple[str, bytes]] = collections.deque()
        self._backlog_bytes = 0
        self._output = KVConnectorOutput()
        self._lock = threading.Condition()
        self._closed = False
        self._abandoned = False  # set when closing gave up waiting for the writes
        self._thread = threading.Thread(target=self._run, name=f"kv-tiers-{rank}", daemon=True)
        self._thread.start()

    # ----- the engine thread ------------------------------------------------------------------------

    def submit(self, work: TransferWork) -> None:
        if self._host is not None:
            for save in work.tier_saves:
                self._host[save.host_slot].copy_(self._blocks[save.block_id])
            if work.tier_saves:
                with self._lock:
                    self._output.tier_stored.extend(("host", save.block_hash) for save in work.tier_saves)
        self._stores_after_forward.extend((s.block_id, s.block_hash, s.media) for s in work.tier_stores)
        if work.tier_loads or work.tier_deletes or work.tier_cancels:
            with self._lock:
                self._loads.extend(work.tier_loads)
                self._writes.extend(work.tier_deletes)
                if work.tier_cancels:
                    self._cancel(set(work.tier_cancels))
                self._lock.notify()

    def _cancel(self, request_ids: set[str]) -> None:
        """Drop the queued loads of these requests, reported failed (one being read is reported when done)."""
        kept = [load for load in self._loads if load.request_id not in request_ids]
        self._output.failed_recving.update(load.request_id for load in self._loads if load.request_id in request_ids)
        self._loads = collections.deque(kept)

    def collect(self) -> KVConnectorOutput | None:
        if self._stores_after_forward:
            self._snapshot_stores()
        with self._lock:
            if not self._output.says_anything():
                return None
            output, self._output = self._output, KVConnectorOutput()
            return output

    def _snapshot_stores(self) -> None:
        stores, self._stores_after_forward = self._stores_after_forward, []
        with self._lock:
            for block_id, block_hash, media in stores:
                if self._backlog_bytes + self.block_bytes > MAX_STORE_BACKLOG_BYTES:
                    self._output.tier_store_failures.extend((medium, block_hash, "backlog") for medium in media)
                    continue
                self._backlog_bytes += self.block_bytes
                row = self._blocks[block_id]
                payload = row.numpy().copy() if self._on_cpu else row.cpu().numpy()
                self._writes.append(_Store(block_hash, media, payload))
            self._lock.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._loads.clear()
            self._lock.notify()
        self._thread.join(timeout=CLOSE_FLUSH_SECONDS)
        if self._thread.is_alive():
            with self._lock:
                self._abandoned = True
                left = len(self._writes)
            logger.warning("KV tiers: %d block writes left undone after %.0f s of closing", left, CLOSE_FLUSH_SECONDS)

    # ----- the I/O thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._loads or self._writes or self._closed):
                    self._lock.wait()
                if self._abandoned or (self._closed and not self._writes):
                    return
                load = self._loads.popleft() if self._loads else None
                write = self._writes.popleft() if load is None else None
            try:
                if load is not None:
                    self._load(load)
                elif isinstance(write, _Store):
                    self._store(write)
                elif write is not None:
                    self._delete(*write)
            except Exception:
                logger.exception("KV tier I/O failed")
                if load is not None:
                    with self._lock:
                        self._output.failed_recving.add(load.request_id)

    def _load(self, load: TierLoad) -> None:
        by_medium: dict[str, list[int]] = {}
        failures: list[tuple[str, bytes, str]] = []
        staging = None if self._on_cpu else np.empty(self.block_bytes, dtype=np.uint8)
        for _, medium, block_hash, _ in load.blocks:
            if medium in self.folders:
                self.folders[medium].prefetch(block_hash)
        for block_id, medium, block_hash, slot in load.blocks:
            started = time.perf_counter()
            if medium == "host":
                assert self._host is not None
                self._blocks[block_id].copy_(self._host[slot])
            else:
                folder = self.folders[medium]
                target = self._blocks[block_id].numpy() if staging is None else staging
                try:
                    folder.read_into(block_hash, target.data)
                except BlockFileError as error:
                    failures.append((medium, block_hash, error.reason))
                    break
                if staging is not None:
                    self._blocks[block_id].copy_(torch.from_numpy(staging))
                if medium in self._touch:
                    folder.touch(block_hash)  # its file's mtime is its last use: what scans (ours, others') age by
            spent = by_medium.setdefault(medium, [0, 0])
            spent[0] += self.block_bytes
            spent[1] += int((time.perf_counter() - started) * 1e9)
        with self._lock:
            output = self._output
            if failures:
                output.tier_load_failures.extend(failures)
                output.failed_recving.add(load.request_id)
            else:
                output.tier_loads.extend((medium, n, ns / 1e9) for medium, (n, ns) in by_medium.items())
                output.finished_recving.add(load.request_id)

    def _store(self, store: _Store) -> None:
        stored: list[tuple[str, bytes]] = []
        failed: list[tuple[str, bytes, str]] = []
        for medium in store.media:
            try:
                self.folders[medium].write(store.block_hash, store.payload.data)
                stored.append((medium, store.block_hash))
            except OSError as error:
                failed.append((medium, store.block_hash, "disk_full" if error.errno == errno.ENOSPC else "io"))
            except Exception:
                logger.exception("KV tier store failed")
                failed.append((medium, store.block_hash, "io"))
        with self._lock:
            self._backlog_bytes -= self.block_bytes
            self._output.tier_stored.extend(stored)
            self._output.tier_store_failures.extend(failed)

    def _delete(self, medium: str, block_hash: bytes) -> None:
        try:
            self.folders[medium].delete(block_hash)
        except OSError as error:
            logger.warning("could not remove a KV block file from the %s tier: %s", medium, error)
