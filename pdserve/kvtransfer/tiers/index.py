"""TierIndex: the scheduler side's picture of one KV tier: which block hashes it holds, in least-recently-used
order, how large it may grow, which blocks a load in flight reads (pinned: not evicted under it), which stores
are ordered but not yet confirmed, and the tier's events and counters.

The worker side only moves bytes; every decision (store or not, what to evict, what has aged out) is taken
here, so the tier's state lives in one place. A host-memory tier's blocks also have slots (its pinned buffer's
rows), handed out here.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from pdserve.api.kv_events import TierEvents
from pdserve.kvtransfer.base import TierStats


class TierIndex:
    def __init__(self, medium: str, capacity_blocks: int, block_bytes: int, max_age_s: float, slots: bool = False):
        """``capacity_blocks`` of ``block_bytes`` each (every rank's share); ``slots``: hand out slot numbers."""
        if capacity_blocks < 1:
            raise ValueError(f"the {medium} tier holds no block: its size is below one block ({block_bytes} bytes)")
        self.medium = medium
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.max_age_s = max_age_s
        self.last_used: OrderedDict[bytes, float] = OrderedDict()  # hash -> time.time() of last use, LRU first
        self.pending: set[bytes] = set()  # stores ordered, not yet confirmed
        self.pinned: dict[bytes, int] = {}  # hash -> loads in flight reading it
        self.slot_of: dict[bytes, int] | None = {} if slots else None
        self._free_slots = list(range(capacity_blocks - 1, -1, -1)) if slots else []
        self.stats = TierStats(capacity_bytes=capacity_blocks * block_bytes)
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.last_used

    def __len__(self) -> int:
        return len(self.last_used)

    # ----- the store side --------------------------------------------------------------------------

    def reserve(self, block_hash: bytes) -> tuple[int, list[tuple[bytes, int]]] | None:
        """Room for a store of ``block_hash``: (its slot or -1, the (hash, slot) evicted for it), or None when
        it is held or being stored already, or every block is pinned by loads."""
        if block_hash in self.last_used or block_hash in self.pending:
            return None
        evicted: list[tuple[bytes, int]] = []
        while len(self.last_used) + len(self.pending) >= self.capacity_blocks:
            victim = next((h for h in self.last_used if h not in self.pinned), None)
            if victim is None:
                break
            evicted.append((victim, self._forget(victim)))
            self.stats.evictions += 1
        if len(self.last_used) + len(self.pending) >= self.capacity_blocks:
            return None
        self.pending.add(block_hash)
        slot = -1
        if self.slot_of is not None:
            slot = self._free_slots.pop()
            self.slot_of[block_hash] = slot
        return slot, evicted

    def stored(self, block_hash: bytes, now: float | None = None) -> None:
        """The worker side confirmed a store (every rank's part)."""
        if block_hash not in self.pending:
            return  # dropped meanwhile (a delete of everything)
        self.pending.discard(block_hash)
        self.last_used[block_hash] = time.time() if now is None else now
        self._stored.append(block_hash)
        self.stats.stored_bytes += self.block_bytes

    def store_failed(self, block_hash: bytes, reason: str) -> None:
        if block_hash in self.pending:
            self.pending.discard(block_hash)
            self._release_slot(block_hash)
        self.stats.store_failures[reason] = self.stats.store_failures.get(reason, 0) + 1

    # ----- the load side ----------------------------------------------------------------------------

    def use(self, block_hash: bytes, now: float) -> None:
        """A load reads the block: it becomes the most recently used, and is pinned until ``unpin``."""
        self.last_used[block_hash] = now
        self.last_used.move_to_end(block_hash)
        self.pinned[block_hash] = self.pinned.get(block_hash, 0) + 1

    def unpin(self, block_hash: bytes) -> None:
        count = self.pinned.get(block_hash, 0) - 1
        if count > 0:
            self.pinned[block_hash] = count
        else:
            self.pinned.pop(block_hash, None)

    def adopt(self, block_hash: bytes, last_used: float) -> list[bytes] | None:
        """Take in a block found in the tier's storage (another engine's file in a shared folder), evicting the
        least recently used for room: the hashes evicted, or None when every block is pinned. It goes to the
        LRU tail: a scan adopts its files oldest first."""
        if block_hash in self.last_used or block_hash in self.pending:
            return []
        evicted: list[bytes] = []
        while len(self.last_used) + len(self.pending) >= self.capacity_blocks:
            victim = next((h for h in self.last_used if h not in self.pinned), None)
            if victim is None:
                return None
            self._forget(victim)
            evicted.append(victim)
            self.stats.evictions += 1
        self.last_used[block_hash] = last_used
        self._stored.append(block_hash)
        return evicted

    def refresh(self, block_hash: bytes, last_used: float) -> None:
        """Another engine used the block later than this one did (a shared file's mtime)."""
        if block_hash in self.last_used and last_used > self.last_used[block_hash]:
            self.last_used[block_hash] = last_used
            self.last_used.move_to_end(block_hash)

    def drop(self, block_hash: bytes, reason: str | None = None) -> int:
        """Forget a block: one that must not be served again (``reason``: corrupt, missing, ..., counted), or
        one gone from storage; its slot, or -1."""
        if reason is not None:
            self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1
        return self._forget(block_hash) if block_hash in self.last_used else -1

    def expire(self, now: float) -> list[tuple[bytes, int]]:
        """Blocks unused for longer than the maximum age (pinned ones wait), removed: (hash, slot)."""
        cutoff = now - self.max_age_s
        expired = [h for h, used in self.last_used.items() if used < cutoff and h not in self.pinned]
        self.stats.evictions += len(expired)
        return [(block_hash, self._forget(block_hash)) for block_hash in expired]

    def _forget(self, block_hash: bytes) -> int:
        del self.last_used[block_hash]
        self._removed.append(block_hash)
        return self._release_slot(block_hash)

    def _release_slot(self, block_hash: bytes) -> int:
        if self.slot_of is None:
            return -1
        slot = self.slot_of.pop(block_hash)
        self._free_slots.append(slot)
        return slot

    # ----- observation ------------------------------------------------------------------------------

    def take_events(self, snapshot: bool) -> TierEvents:
        stored, removed, self._stored, self._removed = self._stored, self._removed, [], []
        return TierEvents(self.medium, stored, removed, list(self.last_used) if snapshot else None)

    def take_stats(self) -> TierStats:
        """The counters now, with the load durations since the last call."""
        stats = self.stats
        taken = TierStats(
            num_blocks=len(self.last_used),
            num_bytes=len(self.last_used) * self.block_bytes,
            capacity_bytes=stats.capacity_bytes,
            hit_tokens=stats.hit_tokens,
            stored_bytes=stats.stored_bytes,
            loaded_bytes=stats.loaded_bytes,
            evictions=stats.evictions,
            skipped=dict(stats.skipped),
            store_failures=dict(stats.store_failures),
            loads_declined=stats.loads_declined,
            load_seconds=stats.load_seconds,
        )
        stats.load_seconds = []
        return taken
