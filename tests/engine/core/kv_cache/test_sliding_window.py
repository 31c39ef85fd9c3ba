"""Sliding windows that slide (vLLM V1's hybrid KV-cache manager): layers grouped by
attention kind (engine/core/kv_cache/groups.py), a windowed group's blocks freed as the
window moves on (NULL_BLOCK in their table entries), allocations counted per group,
prefix-cache hits that a window needs only the end of, hybrid hits every group agrees
on, and the scheduler on top (bounded blocks, preemption, no_evict) with the fake model
checking every position a window reads. Torch-free, like the scheduler."""
import random
from types import SimpleNamespace

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.config.sliding_window import layer_windows
from engine.core.kv_cache import NULL_BLOCK, KVCacheManager, build_layout
from engine.core.kv_cache.events import BlockRemoved, BlockStored
from engine.core.kv_cache.groups import group_peak_blocks
from engine.core.kv_cache.publisher import event_to_wire
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from engine.worker.kv_pool import kv_block_bytes
from testing.fake_model import FakeModelRunner
from testing.sched_invariants import check_drained, check_step

W, BS = 8, 4  # window and block size of most tests: a hit needs ceil(7 / 4) = 2 blocks


def req(rid, prompt, max_tokens=1) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def prefill(kv: KVCacheManager, request: Request, hits=None, num_hit_tokens=0) -> None:
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens  # the scheduler's commit


def decode(kv: KVCacheManager, request: Request, token: int = 7):
    """One more token: appended (as sampled), then allocated and committed."""
    request.all_token_ids.append(token)
    new = kv.allocate_slots(request, 1)
    if new is not None:
        request.num_computed_tokens += 1
    return new


def held(kv: KVCacheManager) -> int:
    return kv.block_pool.num_blocks - kv.num_free_blocks


def uncache(kv: KVCacheManager, block_hash, group: int = 0) -> None:
    """Evict one cached block as a reuse would (it stays free, unfindable)."""
    kv.block_pool.uncache(kv.block_pool.cached_by_group[group][block_hash])


# ---- groups --------------------------------------------------------------------------
def test_one_attention_kind_is_one_group_of_every_layer():
    llama = build_layout([None] * 4)
    assert llama.num_groups == 1 and llama.group_size == 4 and llama.windows == (None,)
    # Llama's layout as before groups: slot l is layer l, a tensor per layer.
    assert llama.layer_slot == (0, 1, 2, 3) and llama.layer_group == (0, 0, 0, 0)
    mistral = build_layout([4096] * 32)
    assert mistral.num_groups == 1 and mistral.group_size == 32 and mistral.windows == (4096,)
    assert mistral.has_window and not llama.has_window


def test_gemma2_alternation_is_two_groups_of_equal_size():
    config = SimpleNamespace(model_type="gemma2", num_hidden_layers=26, sliding_window=4096)
    layout = build_layout(layer_windows(config))
    assert layout.group_size == 13 and layout.windows == (4096, None)
    assert layout.groups[0].layers == tuple(range(0, 26, 2))  # layer 0 is local: group 0
    assert layout.groups[1].layers == tuple(range(1, 26, 2))
    assert layout.layer_slot[5] == 2 and layout.layer_group[5] == 1


def test_gemma3_five_to_one_cuts_the_windowed_layers_into_groups_of_the_full_count():
    config = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=26, sliding_window=512,
                             sliding_window_pattern=6)
    layout = build_layout(layer_windows(config))
    full = (5, 11, 17, 23)
    windowed = [l for l in range(26) if l not in full]
    # 22 windowed layers in groups of 4 (the last holds 2: padding), then the 4 full ones.
    assert layout.group_size == 4 and layout.num_groups == 7
    assert layout.windows == (512,) * 6 + (None,)
    assert [g.layers for g in layout.groups[:6]] == [tuple(windowed[i:i + 4])
                                                     for i in range(0, 22, 4)]
    assert layout.groups[5].layers == (24, 25) and layout.groups[6].layers == full
    assert layout.layer_group[23] == 6 and layout.layer_slot[23] == 3
    assert layout.layer_slot[25] == 1
    # What tensor-parallel workers rebuild it from.
    rebuilt = build_layout(layout.layer_windows)
    assert rebuilt.groups == layout.groups and rebuilt.group_size == 4
    # A block stands for 4 layers' K and V, not 26.
    loaded = SimpleNamespace(num_layers=26, kv_cache_bytes_per_token=lambda: 2 * 26 * 1 * 256 * 2)
    assert kv_block_bytes(loaded, layout, 16) == 2 * 4 * 1 * 256 * 2 * 16
    llama_like = build_layout([None] * 26)
    assert kv_block_bytes(loaded, llama_like, 16) == loaded.kv_cache_bytes_per_token() * 16


def test_kinds_of_close_layer_counts_share_the_larger_size():
    # vLLM's gpt-oss case: 12 windowed and 13 full layers make two groups of 13 (one
    # padding slot), not a group of 12 and a full kind cut into 12 + 1.
    layout = build_layout([128, None] * 12 + [None])
    assert layout.group_size == 13 and layout.num_groups == 2
    assert len(layout.groups[0].layers) == 12 and len(layout.groups[1].layers) == 13


def test_peak_blocks_full_context_or_window_plus_chunk():
    assert group_peak_blocks(None, 100, 4, 16) == 25
    assert group_peak_blocks(8, 100, 4, 1) == 3  # a decode: positions p-7 .. p
    assert group_peak_blocks(8, 100, 4, 16) == 7
    assert group_peak_blocks(8, 5, 4, 16) == 2  # never more than the whole request
    assert build_layout([8, None]).peak_blocks(100, 4, 1) == 3 + 25


# ---- the window manager --------------------------------------------------------------
def test_blocks_behind_the_window_are_freed_and_their_entries_become_null():
    kv = KVCacheManager(num_blocks=16, block_size=BS, layout=build_layout([W]))
    r = req("r", range(1, 13))  # 12 tokens: 3 blocks
    prefill(kv, r)
    assert held(kv) == 3
    for _ in range(40):
        decode(kv, r)
        blocks, ids = kv.req_to_blocks["r"][0], kv.req_to_block_ids["r"][0]
        # Positions before (computed - W + 1) were dropped when this step allocated.
        computed_before = r.num_computed_tokens - 1
        skipped = (computed_before - W + 1) // BS
        assert blocks[:skipped] == [NULL_BLOCK] * skipped
        assert ids[:skipped] == [NULL_BLOCK.block_id] * skipped
        assert NULL_BLOCK not in blocks[skipped:]
        assert len(blocks) == -(-r.num_computed_tokens // BS)  # entries for every position
        assert held(kv) == len(blocks) - skipped <= group_peak_blocks(W, 10**6, BS, 1)
    # The dropped blocks went back to the pool still cached, for other requests' hits.
    assert set(r.block_hashes) <= set(kv.block_pool.cached_blocks)
    kv.free(r)
    assert kv.num_free_blocks == 16 and not kv.req_to_blocks


def test_a_windowed_request_decodes_forever_in_a_pool_too_small_for_its_context():
    kv = KVCacheManager(num_blocks=3, block_size=BS, layout=build_layout([W]))
    r = req("r", range(1, 9))
    prefill(kv, r)
    assert all(decode(kv, r) is not None for _ in range(100))  # 108 tokens, 27 blocks' worth
    full = KVCacheManager(num_blocks=3, block_size=BS)
    f = req("f", range(1, 9))
    prefill(full, f)
    assert [decode(full, f) is not None for _ in range(6)] == [True] * 4 + [False] * 2


def test_allocation_frees_what_the_window_left_before_counting_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, layout=build_layout([W]))
    a, b = req("a", range(1, 13)), req("b", range(50, 54))
    prefill(kv, a)  # 3 blocks
    prefill(kv, b)  # 1 block: the pool is full
    assert kv.num_free_blocks == 0
    # a's next token (position 12) needs a fourth block; its block 0 (positions 0-3) is
    # behind the window of position 12 (5 .. 12) and is freed first, so it fits.
    assert decode(kv, a) is not None
    assert kv.req_to_blocks["a"][0][0] is NULL_BLOCK and kv.num_free_blocks == 0


def test_a_failed_allocation_still_drops_the_blocks_behind_the_window():
    kv = KVCacheManager(num_blocks=5, block_size=BS, layout=build_layout([W]))
    a, b = req("a", range(1, 13)), req("b", range(50, 58))
    prefill(kv, a)
    prefill(kv, b)  # 3 + 2 blocks: full
    a.all_token_ids.extend(range(200, 210))  # a chunk of 10 more tokens needs 3 blocks
    assert kv.allocate_slots(a, 10) is None
    # Nothing taken, but block 0 (never read again) went back all the same.
    assert kv.req_to_blocks["a"][0][0] is NULL_BLOCK and kv.num_free_blocks == 1


def test_free_with_valid_tokens_uncaches_the_unwritten_tail_and_skips_null_entries():
    kv = KVCacheManager(num_blocks=16, block_size=BS, layout=build_layout([W]))
    r = req("r", range(1, 13))
    prefill(kv, r)
    for _ in range(8):
        decode(kv, r)  # 20 tokens: blocks 0-1 dropped
    r.all_token_ids.extend(range(300, 308))
    assert kv.allocate_slots(r, 8) is not None  # 28 tokens allocated and cached
    assert kv.req_to_blocks["r"][0][:2] == [NULL_BLOCK] * 2
    kv.free(r, num_valid_tokens=20)  # preempted before the 8 were computed
    cached = kv.block_pool.cached_blocks
    assert set(r.block_hashes[:5]) <= set(cached) and not set(r.block_hashes[5:7]) & set(cached)
    assert kv.num_free_blocks == 16  # every block back once, NULL_BLOCK never freed
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks) and NULL_BLOCK.ref_cnt == 1


def test_each_group_of_a_hybrid_takes_its_own_blocks_and_only_the_window_slides():
    kv = KVCacheManager(num_blocks=40, block_size=BS, layout=build_layout([W, None]))
    r = req("r", range(1, 13))
    prefill(kv, r)
    assert held(kv) == 6  # 3 blocks in each group
    for _ in range(20):
        decode(kv, r)
    windowed, full = kv.req_to_blocks["r"]
    assert len(windowed) == len(full) == 8
    # The last step allocated at 31 computed tokens: its window is 24 .. 31, blocks 6-7.
    assert windowed[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in windowed[6:] + full
    assert not {b.block_id for b in windowed if b is not NULL_BLOCK} & {b.block_id for b in full}
    assert kv.held_blocks("r") == [2, 8] and held(kv) == 10


# ---- prefix-cache hits ---------------------------------------------------------------
def cached_prompt(kv: KVCacheManager, prompt) -> Request:
    """A request that prefilled `prompt` and ended: its full blocks cached and free."""
    a = req("a", prompt)
    prefill(kv, a)
    kv.free(a)
    return a


def test_a_windowed_hit_needs_only_the_window_before_its_end():
    kv = KVCacheManager(num_blocks=32, block_size=BS, layout=build_layout([W]))
    prompt = list(range(1, 26))  # 25 tokens: 6 full blocks, the 25th token left to compute
    a = cached_prompt(kv, prompt)
    for h in a.block_hashes[:4]:
        uncache(kv, h)  # the head of the prompt is gone from the cache
    (hits,), num_hit_tokens = kv.get_computed_blocks(req("b", prompt))
    assert num_hit_tokens == 24
    assert hits[:4] == [NULL_BLOCK] * 4 and [b.block_hash for b in hits[4:]] == a.block_hashes[4:]
    # Full attention reads the head too: nothing to resume from.
    full = KVCacheManager(num_blocks=32, block_size=BS)
    a = cached_prompt(full, prompt)
    uncache(full, a.block_hashes[0])
    assert full.get_computed_blocks(req("b", prompt)) == (([],), 0)


def test_a_gap_inside_the_window_moves_the_hit_back_to_a_run_long_enough():
    kv = KVCacheManager(num_blocks=32, block_size=BS, layout=build_layout([W]))
    prompt = list(range(1, 26))
    a = cached_prompt(kv, prompt)
    uncache(kv, a.block_hashes[4])  # block 5 alone after the gap: shorter than the window
    (hits,), num_hit_tokens = kv.get_computed_blocks(req("b", prompt))
    assert num_hit_tokens == 16  # ends after block 3: blocks 2 and 3 are its window
    assert hits[:2] == [NULL_BLOCK] * 2
    assert [b.block_hash for b in hits[2:]] == a.block_hashes[2:4]


def test_a_cached_start_shorter_than_the_window_is_a_hit():
    kv = KVCacheManager(num_blocks=32, block_size=BS, layout=build_layout([16]))  # needs 4
    prompt = list(range(1, 10))  # 2 full blocks
    a = cached_prompt(kv, prompt)
    (hits,), num_hit_tokens = kv.get_computed_blocks(req("b", prompt))
    assert num_hit_tokens == 8 and [b.block_hash for b in hits] == a.block_hashes
    uncache(kv, a.block_hashes[0])  # a run that does not reach the start is too short
    assert kv.get_computed_blocks(req("c", prompt)) == (([],), 0)


def test_a_resumed_windowed_hit_allocates_after_its_null_entries():
    kv = KVCacheManager(num_blocks=9, block_size=BS, layout=build_layout([W]))
    prompt = list(range(1, 26))
    a = cached_prompt(kv, prompt)
    for h in a.block_hashes[:4]:
        uncache(kv, h)
    b = req("b", prompt)
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 1, hits) is not None  # the 25th token: one new block
    # Only the two hits and one new block are taken; the nulls are placeholders.
    assert free_before - kv.num_free_blocks == 3
    assert kv.req_to_block_ids["b"][0][:4] == [NULL_BLOCK.block_id] * 4
    assert [b.ref_cnt for b in hits[0][4:]] == [1, 1]


def test_a_hybrid_hit_is_the_length_every_group_agrees_on():
    layout = build_layout([W, None])  # group 0 windowed, group 1 full
    prompt = list(range(1, 26))

    def lookup(evict_windowed=(), evict_full=()):
        kv = KVCacheManager(num_blocks=40, block_size=BS, layout=layout)
        a = cached_prompt(kv, prompt)
        for i in evict_windowed:
            uncache(kv, a.block_hashes[i], group=0)
        for i in evict_full:
            uncache(kv, a.block_hashes[i], group=1)
        hits, num_hit_tokens = kv.get_computed_blocks(req("b", prompt))
        assert len(hits[0]) == len(hits[1]) == num_hit_tokens // BS
        assert NULL_BLOCK not in hits[1]
        assert all(b.group == g for g, group in enumerate(hits) for b in group
                   if b is not NULL_BLOCK)
        return hits, num_hit_tokens

    assert lookup()[1] == 24
    # The windowed group lost its head: no matter, the full group's is what counts.
    hits, n = lookup(evict_windowed=(0, 1, 2))
    assert n == 24 and hits[0][:3] == [NULL_BLOCK] * 3
    # The full group lost block 3: both stop there; the window's blocks 1-2 serve it.
    hits, n = lookup(evict_full=(3,))
    assert n == 12 and hits[0] == [NULL_BLOCK] + hits[0][1:] and NULL_BLOCK not in hits[0][1:]
    # The window has a gap at block 4: its longest hit ends after block 3.
    assert lookup(evict_windowed=(4,))[1] == 16
    # Two rounds: the window first agrees to 6 blocks, the full group cuts to 3, and at 3
    # the window lacks block 1, so only its cached start (block 0) is left.
    assert lookup(evict_windowed=(1,), evict_full=(3,))[1] == 4


# ---- KV events -----------------------------------------------------------------------
def test_events_name_their_group_and_a_windowed_group_says_its_window():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_events=True,
                        layout=build_layout([W, None]))
    a = req("a", range(1, 10))  # 2 full blocks in each group
    prefill(kv, a)
    stored = kv.take_events()
    assert [(type(e).__name__, e.group_idx, e.sliding_window) for e in stored] == [
        ("BlockStored", 0, W), ("BlockStored", 1, None)]
    assert stored[0].block_hashes == stored[1].block_hashes == a.block_hashes[:2]
    wire = [event_to_wire(e) for e in stored]
    assert wire[0]["group_idx"] == 0 and wire[0]["kv_cache_spec_kind"] == "sliding_window"
    assert wire[0]["kv_cache_spec_sliding_window"] == W
    assert wire[1]["group_idx"] == 1 and "kv_cache_spec_kind" not in wire[1]
    kv.free(a)
    b = req("b", range(100, 124))  # 6 blocks: reuses every freed block, evicting both copies
    assert kv.allocate_slots(b, 12) is not None
    removed = kv.take_events()
    gone = [e for e in removed if isinstance(e, BlockRemoved)]
    assert sorted((e.group_idx, h) for e in gone for h in e.block_hashes) == sorted(
        (g, h) for g in (0, 1) for h in a.block_hashes[:2])
    assert all(event_to_wire(e)["group_idx"] == e.group_idx for e in gone)
    assert any(isinstance(e, BlockStored) for e in removed)  # b's blocks, announced


# ---- the scheduler on top ------------------------------------------------------------
def _scheduler(layout, num_blocks, **sched) -> Scheduler:
    config = dict(max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8)
    config.update(sched)
    return Scheduler(SchedulerConfig(**config),
                     CacheConfig(num_kv_blocks=num_blocks, block_size=BS), kv_layout=layout)


def _drive(s: Scheduler, runner: FakeModelRunner, on_step=None, max_steps=20000) -> dict:
    outputs, steps = {}, 0
    while s.has_unfinished_requests():
        out = s.schedule()
        check_step(s, out)
        if on_step is not None:
            on_step(s, out)
        for r in s.update_from_output(out, runner.execute(out)):
            if r.is_finished:
                outputs[r.request_id] = r.output_token_ids
        steps += 1
        assert steps < max_steps
    check_drained(s)
    return outputs


def test_a_request_of_six_windows_holds_blocks_bounded_by_the_window():
    s = _scheduler(build_layout([W]), num_blocks=64, max_num_batched_tokens=8)
    s.add_request(req("long", range(1, 9), max_tokens=6 * W))
    peak = []

    def on_step(sched, out):
        peak.append(held(sched.kv_cache_manager))

    _drive(s, FakeModelRunner(64, BS, windows=(W,)), on_step)
    # Prefill: 8 tokens in 2 blocks; every decode after: the window's 3 blocks at most.
    # Kept, the 56 tokens would have taken 14.
    assert max(peak) <= group_peak_blocks(W, 10**6, BS, 8) and max(peak[1:]) <= 3
    assert len(peak) == 1 + 6 * W - 1


@pytest.mark.parametrize("windows", [(W,), (W, None), (None, W, 12)])
def test_preemption_prefix_hits_and_chunks_keep_every_windowed_read_right(windows):
    """Random prompts over a few shared prefixes, a pool that forces preemptions: the
    fake model checks every position each group's queries read, each step."""
    rng = random.Random(7)
    layout = build_layout(list(windows))
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(6, 30))] for _ in range(3)]
    num_blocks = 12 * layout.num_groups
    s = _scheduler(layout, num_blocks, max_model_len=128, long_prefill_token_threshold=7)
    runner = FakeModelRunner(num_blocks, BS, windows=layout.windows)
    for i in range(24):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 12))]
        s.add_request(req(f"r{i}", prompt, max_tokens=rng.randrange(1, 40)))
    outputs = _drive(s, runner)
    assert len(outputs) == 24
    assert s.num_preemptions_total > 0 and s.kv_cache_manager.prefix_cache_stats.hits > 0


def test_no_evict_admission_counts_a_window_not_the_whole_context():
    def run(layout):
        s = _scheduler(layout, num_blocks=24 * layout.num_groups, max_num_batched_tokens=8,
                       admission="no_evict")
        for i in range(6):
            s.add_request(req(f"r{i}", [i * 50 + t for t in range(1, 9)], max_tokens=56))
        running = []
        _drive(s, FakeModelRunner(24 * layout.num_groups, BS, windows=layout.windows),
               lambda sched, out: running.append(len(sched.running)))
        assert s.num_preemptions_total == 0
        return max(running)

    # 64 tokens are 16 blocks of full attention: one request at a time in 24 blocks.
    assert run(build_layout([None])) == 1
    # With the window, a request holds at most (8 + 8 - 2) // 4 + 2 = 5 blocks.
    assert run(build_layout([W])) == 4
    # A hybrid's full group still needs all 16: 16 + 5 a request, two in 48 blocks.
    assert run(build_layout([W, None])) == 2


def test_a_gemma_3_1b_request_at_8k_holds_its_full_layers_and_windows_only():
    # Gemma-3-1B's own layout (26 layers, every sixth global, 512-token windows), one
    # request prefilled in 512-token chunks to 8k and decoding: its KV in layer-blocks
    # (held blocks x layers per block) stays at the full layers' whole context plus each
    # windowed layer's window (+ a chunk), about a quarter of 26 full layers'.
    config = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=26,
                             sliding_window=512, sliding_window_pattern=6)
    layout = build_layout(layer_windows(config))
    block_size, chunk, context = 16, 512, 8192
    kv = KVCacheManager(num_blocks=4096, block_size=block_size, layout=layout)
    r = req("r", range(1, context - 63))
    peak = 0
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        peak = max(peak, held(kv))
    while r.num_tokens < context:
        assert decode(kv, r) is not None
        peak = max(peak, held(kv))
    full_layers = sum(w is None for w in layer_windows(config))
    windowed_layers = len(layout.groups) * layout.group_size - full_layers  # padding included
    bound = (full_layers * (context // block_size)
             + windowed_layers * ((512 + chunk - 2) // block_size + 2))
    assert full_layers == 4 and layout.group_size == 4
    assert peak * layout.group_size <= bound
    assert peak * layout.group_size < 0.3 * 26 * (context // block_size)
