"""engine.core.kv_cache.block_pool: the LRU free queue, lazy eviction of cached blocks
(findable until reused, then one BlockRemoved per allocation), duplicates, ref counts."""
import pytest

from engine.core.kv_cache import AllBlocksCleared, BlockPool, BlockRemoved


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_new_blocks_come_from_the_lru_head_and_freed_ones_join_the_tail():
    pool = BlockPool(4)
    first = pool.get_new_blocks(2)
    assert ids(first) == [0, 1] and pool.num_free_blocks == 2 and pool.usage == 0.5
    assert all(b.ref_cnt == 1 for b in first)
    pool.free_blocks(reversed(first))  # in eviction order: 1 before 0
    assert ids(pool.get_new_blocks(4)) == [2, 3, 1, 0] and pool.usage == 1.0


def test_a_freed_cached_block_is_found_until_reused_and_then_removed_in_one_event():
    pool = BlockPool(3, enable_events=True)
    b0, b1, b2 = pool.get_new_blocks(3)
    assert pool.cache_block(b0, 100) and pool.cache_block(b1, 101)
    pool.free_blocks([b1, b0])
    assert pool.get_cached_block(100) is b0 and b0.ref_cnt == 0
    pool.touch([b0])  # a prefix hit revives it out of the free queue
    assert b0.ref_cnt == 1 and ids(pool.free_queue.values()) == [1]
    pool.free_blocks([b2, b0])
    assert pool.take_events() == []
    # Reuse: the queue is b1, b2, b0; b1 and b0 still carry hashes, b2 never had one.
    assert ids(pool.get_new_blocks(3)) == [1, 2, 0]
    assert not pool.cached_blocks and b0.block_hash is None and b1.block_hash is None
    assert pool.take_events() == [BlockRemoved([101, 100])]
    assert pool.take_events() == []


def test_a_duplicate_stays_uncached_and_the_first_copy_keeps_the_hash():
    pool = BlockPool(2, enable_events=True)
    first, copy = pool.get_new_blocks(2)
    assert pool.cache_block(first, 7)
    assert not pool.cache_block(copy, 7) and copy.block_hash is None
    assert not pool.cache_block(first, 8) and first.block_hash == 7  # hashed once only
    pool.free_blocks([copy])
    pool.get_new_blocks(1)  # reusing the copy evicts nothing
    assert pool.get_cached_block(7) is first and pool.take_events() == []


def test_uncache_forgets_only_the_block_that_serves_the_hash():
    pool = BlockPool(2, enable_events=True)
    block, other = pool.get_new_blocks(2)
    pool.cache_block(block, 5)
    pool.uncache(other)  # no hash: nothing to forget
    pool.uncache(block)
    assert pool.get_cached_block(5) is None and block.block_hash is None
    assert pool.take_events() == [BlockRemoved([5])]


def test_reset_forgets_every_hash_in_one_event():
    pool = BlockPool(2, enable_events=True)
    used, freed = pool.get_new_blocks(2)
    pool.cache_block(used, 1)
    pool.cache_block(freed, 2)
    pool.free_blocks([freed])
    pool.reset_prefix_cache()
    assert not pool.cached_blocks and used.block_hash is None and freed.block_hash is None
    pool.get_new_blocks(1)  # the freed block: nothing left to evict
    assert pool.take_events() == [AllBlocksCleared()]


def test_events_are_kept_only_when_enabled():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 3)
    pool.free_blocks([block])
    pool.get_new_blocks(1)
    assert pool.events is None and pool.take_events() == []


def test_overdraw_and_double_free_raise():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="asked for 3 blocks, 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])
