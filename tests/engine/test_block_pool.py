"""BlockPool: ref counts, LRU free queue, cached hashes kept until eviction."""

import pytest

from pdserve.engine.block_hash import hash_block_tokens
from pdserve.engine.block_pool import BlockPool


def _hash(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_new_blocks_come_from_the_lru_head_and_freed_blocks_join_the_tail():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id, a.ref_cnt) == (0, 1, 1)
    assert pool.num_free_blocks == 2
    pool.free_blocks([b, a])
    # Queue is now 2, 3, 1, 0: the oldest-freed blocks are reused first.
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [2, 3, 1, 0]


def test_freed_cached_block_can_be_hit_until_evicted():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, _hash(1))
    pool.free_blocks([block])
    assert pool.get_cached_block(_hash(1)) is block
    assert pool.usage == 0.0  # a free cached block counts as free

    pool.touch([block])  # a prefix hit takes it back out of the free queue
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([block])  # a second owner
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_queue
    pool.free_blocks([block])

    pool.get_new_blocks(1)  # block 1 (never cached) is older in the queue: no eviction yet
    assert pool.get_cached_block(_hash(1)) is block and pool.num_evictions == 0
    pool.get_new_blocks(1)  # now the cached block is reused: its hash is evicted
    assert pool.get_cached_block(_hash(1)) is None and block.block_hash is None
    assert pool.num_evictions == 1


def test_one_block_per_hash():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, _hash(7))
    pool.cache_block(second, _hash(7))  # same content computed twice: only one is registered
    assert pool.get_cached_block(_hash(7)) is first and second.block_hash is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(1, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, _hash(1))
    assert pool.get_cached_block(_hash(1)) is None


def test_errors_and_reset():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, _hash(3))
    assert not pool.reset_prefix_cache()  # a block is still owned
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(_hash(3)) is None


def test_a_block_generation_changes_when_it_loses_its_last_owner():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks[:1])  # block 0 now has two owners
    pool.free_blocks(blocks)
    assert pool.generations.tolist() == [0, 1, 0, 0]  # block 0 still owned: unchanged
    pool.free_blocks(blocks[:1])
    assert pool.generations.tolist() == [1, 1, 0, 0]
    pool.touch(blocks[:1])  # a prefix-cache hit on a free block: same content, same generation
    assert pool.generations.tolist() == [1, 1, 0, 0]
