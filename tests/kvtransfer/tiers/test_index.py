"""TierIndex (a tier's hashes, LRU order, bound, pins, slots, events, counters) and LoadOrRecompute (load
or recompute, by measured figures)."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.tiers.cost import EXPLORE_EVERY, MIN_TIMED_TOKENS, LoadOrRecompute
from pdserve.kvtransfer.tiers.index import TierIndex

from .helpers import block_hash

BLOCK_BYTES = 1000
A, B, C, D, E = (block_hash(n) for n in range(5))


def _index(capacity: int = 4, slots: bool = False, max_age_s: float = 100.0) -> TierIndex:
    return TierIndex("disk", capacity, BLOCK_BYTES, max_age_s, slots)


def _store(index: TierIndex, block: bytes, now: float) -> None:
    assert index.reserve(block) is not None
    index.stored(block, now)


# ----- TierIndex ----------------------------------------------------------------------------------


def test_an_index_below_one_block_is_refused():
    with pytest.raises(ValueError, match="below one block"):
        TierIndex("disk", 0, BLOCK_BYTES, 100.0)


def test_reserve_then_stored_holds_the_block_once():
    index = _index()
    assert index.reserve(A) == (-1, [])
    assert A in index.pending and A not in index and len(index) == 0
    assert index.reserve(A) is None  # being stored already
    index.stored(A, 5.0)
    assert A in index and A not in index.pending and index.last_used[A] == 5.0
    assert index.reserve(A) is None  # held already
    assert index.stats.stored_bytes == BLOCK_BYTES
    index.stored(A, 6.0)  # a confirmation of nothing pending: ignored
    index.stored(B, 6.0)
    assert B not in index and index.stats.stored_bytes == BLOCK_BYTES and index.last_used[A] == 5.0


def test_a_failed_store_frees_its_reservation_and_is_counted():
    index = _index(capacity=1)
    assert index.reserve(A) is not None
    assert index.reserve(B) is None  # the one place is A's, and a pending store is not evictable
    index.store_failed(A, "disk_full")
    index.store_failed(C, "io")  # not pending: only counted
    assert A not in index.pending and A not in index
    assert index.stats.store_failures == {"disk_full": 1, "io": 1}
    assert index.reserve(B) == (-1, [])


def test_a_full_index_evicts_its_least_recently_used_blocks_first():
    index = _index(capacity=3)
    for now, block in enumerate((A, B, C)):
        _store(index, block, float(now))
    index.use(A, 10.0)  # a load read A: now the most recently used
    index.unpin(A)
    assert list(index.last_used) == [B, C, A]
    assert index.reserve(D) == (-1, [(B, -1)])
    index.stored(D, 11.0)
    assert index.reserve(E) == (-1, [(C, -1)])
    assert set(index.last_used) == {A, D} and E in index.pending
    assert index.stats.evictions == 2
    events = index.take_events(snapshot=False)
    assert events.removed == [B, C]


def test_pinned_blocks_are_never_evicted():
    index = _index(capacity=2)
    _store(index, A, 1.0)
    _store(index, B, 2.0)
    index.use(B, 3.0)
    index.use(A, 4.0)
    index.use(A, 4.0)  # two loads read A
    assert index.reserve(C) is None  # everything pinned: no room, nothing evicted
    assert set(index.last_used) == {A, B} and index.stats.evictions == 0 and not index.pending
    index.unpin(A)
    assert index.reserve(C) is None  # A still has a load in flight
    index.unpin(A)
    assert list(index.last_used) == [B, A]
    assert index.reserve(C) == (-1, [(A, -1)])  # the least recently used, B, is pinned: A goes
    index.unpin(B)
    index.unpin(B)  # more unpins than pins: harmless
    assert index.pinned == {}


def test_slots_are_handed_out_and_recycled():
    index = _index(capacity=2, slots=True)
    assert index.reserve(A) == (0, [])
    assert index.reserve(B) == (1, [])
    assert index.slot_of == {A: 0, B: 1}
    index.stored(A, 1.0)
    index.stored(B, 2.0)
    assert index.reserve(C) == (0, [(A, 0)])  # A's slot goes to C
    index.store_failed(C, "io")  # C's slot comes back
    assert index.slot_of == {B: 1}
    assert index.reserve(D) == (0, [])
    index.stored(D, 3.0)
    assert index.drop(B, "corrupt") == 1
    assert index.reserve(E) == (1, [])
    assert sorted(index.slot_of.values()) == [0, 1]


def test_expire_removes_blocks_past_their_age_but_not_pinned_ones():
    index = _index(capacity=4, slots=True, max_age_s=10.0)
    _store(index, A, 0.0)
    _store(index, B, 0.0)
    _store(index, C, 95.0)
    index.use(B, 0.0)  # pinned at its old use time
    slot_a = index.slot_of[A]
    assert index.expire(100.0) == [(A, slot_a)]
    assert set(index.last_used) == {B, C} and index.stats.evictions == 1
    index.unpin(B)
    slot_b = index.slot_of[B]
    assert index.expire(100.0) == [(B, slot_b)]
    assert set(index.last_used) == {C}
    assert index.expire(105.0) == []  # exactly at the age: kept
    assert [block for block, _ in index.expire(105.1)] == [C]


def test_drop_forgets_a_block_and_counts_the_reason():
    index = _index()
    _store(index, A, 1.0)
    assert index.drop(A, "corrupt") == -1
    assert A not in index
    assert index.drop(B, "missing") == -1  # not held: only counted
    index.drop(C, "corrupt")
    assert index.stats.skipped == {"corrupt": 2, "missing": 1}
    assert index.take_events(snapshot=False).removed == [A]
    assert index.stats.evictions == 0  # a dropped block is not an eviction


def test_adopt_takes_found_blocks_evicting_the_least_recently_used_for_room():
    index = _index(capacity=2)
    assert index.adopt(A, 50.0) == []
    assert index.adopt(A, 60.0) == []  # held already: fine, unchanged
    assert index.last_used[A] == 50.0
    assert index.reserve(B) is not None
    assert index.adopt(B, 70.0) == []  # being stored: fine
    assert index.adopt(C, 80.0) == [A]  # full: the least recently used goes
    assert C in index and A not in index
    index.use(C, 90.0)  # pinned by a load, and B is pending: nothing can go
    assert index.adopt(D, 95.0) is None and D not in index
    assert index.stats.stored_bytes == 0  # found, not stored by this engine
    assert index.take_events(snapshot=False).stored == [A, C]


def test_events_are_taken_once_and_a_snapshot_lists_every_held_block():
    index = _index(capacity=2)
    _store(index, A, 1.0)
    _store(index, B, 2.0)
    _store(index, C, 3.0)  # evicts A
    events = index.take_events(snapshot=True)
    assert events.medium == "disk"
    assert events.stored == [A, B, C] and events.removed == [A] and events.snapshot == [B, C]
    events = index.take_events(snapshot=False)
    assert events.stored == [] and events.removed == [] and events.snapshot is None


def test_stats_hand_over_load_durations_once():
    index = _index(capacity=4)
    _store(index, A, 1.0)
    _store(index, B, 2.0)
    index.stats.load_seconds += [0.5, 0.25]
    index.stats.hit_tokens += 32
    index.stats.skipped["corrupt"] = 1
    stats = index.take_stats()
    assert (stats.num_blocks, stats.num_bytes, stats.capacity_bytes) == (2, 2 * BLOCK_BYTES, 4 * BLOCK_BYTES)
    assert stats.load_seconds == [0.5, 0.25] and stats.hit_tokens == 32 and stats.stored_bytes == 2 * BLOCK_BYTES
    stats.skipped["corrupt"] = 99  # a copy: the index's counter is not changed through it
    again = index.take_stats()
    assert again.load_seconds == [] and again.hit_tokens == 32 and again.skipped == {"corrupt": 1}


# ----- LoadOrRecompute ----------------------------------------------------------------------------


def _slow_disk() -> LoadOrRecompute:
    """Figures by which loading a block (1 s) is far slower than computing its 16 tokens (16 ms)."""
    cost = LoadOrRecompute(rank_block_bytes=1000)
    cost.note_step(64, 0.064)
    cost.note_load("disk", 1000, 1.0)
    return cost


def test_loads_while_a_figure_is_unknown():
    cost = LoadOrRecompute(rank_block_bytes=1000)
    assert cost.estimate({"disk": 1}, 16) is None
    for _ in range(3 * EXPLORE_EVERY):
        assert cost.worth_loading({"disk": 1}, 16)
    cost.note_step(64, 0.064)
    assert cost.estimate({"disk": 1}, 16) is None  # the disk's bandwidth is still unknown
    assert cost.worth_loading({"disk": 1}, 16)
    cost.note_load("disk", 1000, 1.0)
    assert cost.estimate({"disk": 1}, 16) == pytest.approx((1.064, 0.016))
    assert cost.estimate({"shared": 1}, 16) is None  # another medium's is not
    assert cost.worth_loading({"shared": 1}, 16)


def test_declines_a_slower_load_but_explores_once_every_explore_every_declines():
    cost = _slow_disk()
    answers = [cost.worth_loading({"disk": 1}, 16) for _ in range(3 * EXPLORE_EVERY)]
    assert [n for n, yes in enumerate(answers, 1) if yes] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY, 3 * EXPLORE_EVERY]
    # A load that is faster than computing is taken (and does not count as a decline).
    assert cost.worth_loading({"disk": 1}, 100_000)


def test_small_steps_time_the_step_but_not_the_per_token_rate():
    cost = LoadOrRecompute(rank_block_bytes=1000)
    cost.note_step(MIN_TIMED_TOKENS - 1, 0.5)
    assert cost.step_seconds == 0.5 and cost.seconds_per_token is None
    cost.note_step(0, 1.0)
    cost.note_step(64, 0.0)
    cost.note_step(-1, 1.0)
    assert cost.step_seconds == 0.5 and cost.seconds_per_token is None  # nothing or no time: ignored
    cost.note_step(MIN_TIMED_TOKENS, 0.032)
    assert cost.seconds_per_token == pytest.approx(0.001)
    assert cost.step_seconds == pytest.approx(0.5 + 0.2 * (0.032 - 0.5))  # a moving average
    cost.note_step(MIN_TIMED_TOKENS, 0.064)
    assert cost.seconds_per_token == pytest.approx(0.001 + 0.2 * 0.001)


def test_a_load_without_bytes_or_time_is_not_a_sample():
    cost = LoadOrRecompute(rank_block_bytes=1000)
    cost.note_load("disk", 0, 1.0)
    cost.note_load("disk", 1000, 0.0)
    assert cost.seconds_per_byte == {}
    cost.note_load("disk", 1000, 1.0)
    cost.note_load("disk", 1000, 2.0)
    assert cost.seconds_per_byte["disk"] == pytest.approx(0.001 + 0.2 * 0.001)
