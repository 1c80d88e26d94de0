"""BlockPool: the fixed set of KV blocks, their reference counts, the LRU free queue and the
map from block hash to cached block.

A block with ``ref_cnt == 0`` sits in the free queue. If it carries a hash it still holds a
reusable prefix: a later request can take it back (a prefix-cache hit) until the block is
popped for new data, which evicts its hash. Freed blocks join the queue's tail and new blocks
come from its head, so eviction is least-recently-used.

Each block also has a generation number, bumped whenever the block loses its last owner. A KV
connector hands a remote reader the generations of the blocks it holds; the reader checks them
after its read, so a read that raced with the blocks being freed (and maybe overwritten) is
detected rather than served. The numbers live in one int64 array that a connector can register
for remote reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from pdserve.engine.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={cached})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, generations: np.ndarray | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in LRU order (head evicted first). OrderedDict gives O(1) removal
        # from the middle when a free cached block is hit again.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        if generations is None:
            generations = np.zeros(num_blocks, dtype=np.int64)  # no transfer agent shares them
        elif generations.shape != (num_blocks,) or generations.dtype != np.int64:
            raise ValueError(
                f"block generations must be int64[{num_blocks}], got {generations.dtype}{list(generations.shape)}"
            )
        # Shared with the KV connector's worker side, which registers it for remote reads.
        self.generations = generations
        # Hashes that entered / left the cache since the KV-event publisher last took them
        # (None: nobody publishes, nothing is recorded).
        self.stored_log: list[BlockHash] | None = None
        self.removed_log: list[BlockHash] | None = None
        # (block id, hash) of blocks cached / evicted since the scheduler last handed them to a KV connector that
        # stores blocks in tiers (None: no connector wants them).
        self.cached_log: list[tuple[int, BlockHash]] | None = None
        self.evicted_log: list[tuple[int, BlockHash]] | None = None

    def record_events(self) -> None:
        """Start recording cache changes for a KV-event publisher (pdserve/engine/kv_events.py)."""
        self.stored_log, self.removed_log = [], []

    def record_for_connector(self, cached: bool, evicted: bool) -> None:
        """Start recording cached and/or evicted blocks for a KV connector's store side."""
        self.cached_log = [] if cached else None
        self.evicted_log = [] if evicted else None

    def take_cached(self) -> list[tuple[int, BlockHash]]:
        taken, self.cached_log = self.cached_log or [], [] if self.cached_log is not None else None
        return taken

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        taken, self.evicted_log = self.evicted_log or [], [] if self.evicted_log is not None else None
        return taken

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """The hashes stored and removed since the last call (both empty unless recording)."""
        stored, removed = self.stored_log or [], self.removed_log or []
        if self.stored_log is not None:
            self.stored_log, self.removed_log = [], []
        return stored, removed

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by someone (free blocks that still cache a prefix count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the LRU head, evicting their cached hashes. Ref count 1."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot take {num_blocks} blocks, only {len(self.free_queue)} free")
        popitem = self.free_queue.popitem
        new_blocks = []
        for _ in range(num_blocks):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                if self.removed_log is not None:
                    self.removed_log.append(block.block_hash)
                if self.evicted_log is not None:
                    self.evicted_log.append((block.block_id, block.block_hash))
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one owner to each block (a prefix-cache hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one owner from each block; those left without owners join the LRU tail in order.

        Callers pass a request's blocks tail first, so its last (least shared) blocks are evicted first.
        """
        free_queue = self.free_queue
        freed = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free_queue[block.block_id] = block
                freed.append(block.block_id)
        if freed:
            self.generations[freed] += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, owned block under its hash.

        If another block already caches the same content (two requests computed the same
        prefix at once), this one stays unregistered and is simply reused when freed.
        """
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            if self.stored_log is not None:
                self.stored_log.append(block_hash)
            if self.cached_log is not None:
                self.cached_log.append((block.block_id, block_hash))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is owned (returns False otherwise)."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        if self.removed_log is not None:
            self.removed_log.extend(self.cached_blocks)
        self.cached_blocks.clear()
        return True
