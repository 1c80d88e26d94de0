"""StateSlotManager: which state slot each request owns, for hybrid models' linear-attention layers.

A linear-attention layer keeps a fixed-size state per request (a convolution window and a recurrent
matrix), not KV per token: a request needs one slot from admission to its end, whatever its
length. The worker holds the slots' tensors and zeroes a slot when its request is scheduled from
position 0; this manager only hands out slot numbers. A preempted request loses its slot and
recomputes from its first token (its state cannot be rebuilt from the prefix cache).

A slot lives in rows of the KV-cache tensor past the pool's blocks (``first_row`` on), so it moves
between P/D engines as blocks do; like a block, each of its rows has a generation, bumped when the
slot loses its owner, which a remote reader checks after a pull.
"""

from __future__ import annotations

import numpy as np


class StateSlotManager:
    def __init__(self, num_slots: int, first_row: int, rows_per_slot: int, generations: np.ndarray | None) -> None:
        """``generations``: the cache's row generations (the block pool's array, which covers these
        rows too); None when nothing reads them remotely."""
        if num_slots < 1 or rows_per_slot < 1:
            raise ValueError(f"a hybrid model needs state slots of at least one row, got {num_slots} x {rows_per_slot}")
        if generations is not None and len(generations) < first_row + num_slots * rows_per_slot:
            raise ValueError(f"{len(generations)} row generations do not cover {num_slots} slots after row {first_row}")
        self.num_slots = num_slots
        self.first_row = first_row
        self.rows_per_slot = rows_per_slot
        self.generations = generations
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.req_to_slot: dict[str, int] = {}
        self.quarantined: dict[str, list[int]] = {}  # request id -> slots a write may still reach

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def has_slot(self, request_id: str) -> bool:
        return request_id in self.req_to_slot

    def allocate(self, request_id: str) -> int:
        """The request's slot, taken now if it has none (callers check ``num_free_slots`` first)."""
        slot = self.req_to_slot.get(request_id)
        if slot is None:
            slot = self.req_to_slot[request_id] = self._free.pop()
        return slot

    def slot_of(self, request_id: str) -> int:
        return self.req_to_slot[request_id]

    def rows_of(self, request_id: str) -> list[int]:
        """The cache rows the request's slot occupies (what a transfer moves)."""
        start = self.first_row + self.req_to_slot[request_id] * self.rows_per_slot
        return list(range(start, start + self.rows_per_slot))

    def free(self, request_id: str) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self._release(slot)

    def _release(self, slot: int) -> None:
        if self.generations is not None:
            start = self.first_row + slot * self.rows_per_slot
            self.generations[start : start + self.rows_per_slot] += 1
        self._free.append(slot)

    def quarantine(self, request_id: str) -> None:
        """Take the request's slot away without freeing it (a load into it may still be writing)."""
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self.quarantined.setdefault(request_id, []).append(slot)

    def release_quarantine(self, request_id: str) -> None:
        for slot in self.quarantined.pop(request_id, ()):
            self._release(slot)
