"""engine.core.kv_cache.manager: block tables on the BlockPool, prefix lookups that leave
the last token to compute, allocations that never count a free cache hit as room, and
frees that evict a chain's tail first and uncache blocks whose KV was never written."""
from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams


def req(rid, prompt) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=1))


def prefilled_and_freed(kv: KVCacheManager, request: Request) -> list[int]:
    """As a request that ended after its prefill: its prompt computed, then its blocks
    freed. Returns the ids of the blocks it had."""
    assert kv.allocate_slots(request, request.num_tokens) is not None
    block_ids = list(kv.req_to_block_ids[request.request_id][0])
    kv.free(request)
    return block_ids


def test_a_hit_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a_blocks = prefilled_and_freed(kv, req("a", range(1, 9)))  # two full blocks, cached
    (hits,), num_hit_tokens = kv.get_computed_blocks(req("same", range(1, 9)))
    assert num_hit_tokens == 4 and [b.block_id for b in hits] == a_blocks[:1]
    (hits,), num_hit_tokens = kv.get_computed_blocks(req("longer", range(1, 10)))
    assert num_hit_tokens == 8 and [b.block_id for b in hits] == a_blocks
    assert kv.get_computed_blocks(req("other", range(2, 10))) == (([],), 0)


def test_allocate_never_counts_free_cache_hits_as_free_space():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefix = list(range(1, 9))  # two blocks
    prefilled_and_freed(kv, req("a", prefix))
    assert kv.num_free_blocks == 4 and len(kv.block_pool.cached_blocks) == 2
    b = req("b", prefix + list(range(50, 59)))  # 17 tokens: 5 blocks in all
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and all(h.ref_cnt == 0 for h in hits[0])
    # 3 new blocks <= 4 free, but 2 of the free ones are the hits themselves.
    assert kv.allocate_slots(b, 9, hits) is None
    assert kv.num_free_blocks == 4 and all(h.ref_cnt == 0 for h in hits[0])
    assert "b" not in kv.req_to_blocks
    # One token less needs one block less: the hits and two new blocks take the pool.
    c = req("c", prefix + list(range(50, 58)))
    hits, _ = kv.get_computed_blocks(c)
    assert len(kv.allocate_slots(c, 8, hits)[0]) == 2
    assert kv.num_free_blocks == 0 and all(h.ref_cnt == 1 for h in hits[0])


def test_allocation_keeps_the_reserve_and_the_block_ids_mirror_the_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = req("r", range(1, 10))  # 9 tokens: 3 blocks
    assert kv.allocate_slots(r, 9, num_reserved_blocks=2) is None  # 4 - 3 < 2
    assert kv.num_free_blocks == 4 and "r" not in kv.req_to_blocks
    assert len(kv.allocate_slots(r, 9, num_reserved_blocks=1)[0]) == 3
    r.num_computed_tokens = 9  # the scheduler's commit
    assert kv.allocate_slots(r, 3) == ([],)  # positions 9-11 fit in the third block
    assert len(kv.allocate_slots(r, 4)[0]) == 1
    assert kv.req_to_block_ids["r"] == ([b.block_id for b in kv.req_to_blocks["r"][0]],)
    assert len(set(kv.req_to_block_ids["r"][0])) == 4 and kv.usage == 1.0
    kv.free(r)
    assert kv.num_free_blocks == 4 and not kv.req_to_blocks and not kv.req_to_block_ids


def test_without_caching_nothing_is_cached_or_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    prefilled_and_freed(kv, req("a", range(1, 9)))
    assert not kv.block_pool.cached_blocks
    assert kv.get_computed_blocks(req("b", range(1, 10))) == (([],), 0)


def test_freed_chain_is_evicted_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    prefilled_and_freed(kv, req("a", prompt))
    # Need 4 new blocks: the 2 never-used blocks go first, then the chain's tail.
    assert len(kv.allocate_slots(req("filler", range(100, 113)), 13)[0]) == 4
    _, hit = kv.get_computed_blocks(req("b", prompt))
    assert hit == 8  # head and middle block survived, the tail block was evicted


def test_free_uncaches_blocks_whose_kv_was_never_written():
    # A request can be preempted in the step that granted it tokens (priority policy):
    # blocks registered at allocation must not serve later prefix hits.
    kv = KVCacheManager(num_blocks=1000, block_size=4)
    r = req("r", range(1, 13))
    assert kv.allocate_slots(r, 12) is not None  # three full blocks, cached at allocation
    assert len(kv.block_pool.cached_blocks) == 3
    kv.free(r, num_valid_tokens=5)  # only block 0 (and a bit of block 1) was computed
    assert list(kv.block_pool.cached_blocks) == [r.block_hashes[0]]
    assert kv.num_free_blocks == 1000
