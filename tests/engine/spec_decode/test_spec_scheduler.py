"""Speculative decoding as the scheduler and the KV manager see it, driven by the fake
model (testing/fake_model.py verifies drafts as greedy decoding does and checks every
K/V slot a request reads): drafts ride in the token budget, rejected ones leave no
trace in blocks, hashes or progress, and outputs equal a run that never proposed."""
import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from testing.fake_model import FakeModelRunner, next_token
from testing.sched_invariants import check_drained, check_state, schedule

VOCAB = 50


def make(num_blocks=200, block_size=4, num_spec_tokens=4, lookahead=0, **sched):
    sched.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(**sched),
                     CacheConfig(num_kv_blocks=num_blocks, block_size=block_size,
                                 enable_prefix_caching=True),
                     num_spec_tokens=num_spec_tokens, num_lookahead_tokens=lookahead)


def requests(seed, num=6, max_tokens=30):
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(9)]
    return [Request(f"r{i}", (shared if i % 2 else []) + [rng.randrange(1, VOCAB)
                                                         for _ in range(rng.randint(2, 13))],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i in range(num)]


def truth(request, j):
    """The token greedy decoding gives after the request's tokens and j more true ones."""
    tokens = list(request.all_token_ids)
    for _ in range(j + 1):
        tokens.append(next_token(tokens, VOCAB))
    return tokens[-1]


def propose(scheduler, rng, k, right=0.7):
    """Drafts for running requests due a sample: true tokens, each wrong with 1 - right."""
    for request in scheduler.running:
        if request.num_computed_tokens != request.num_tokens - 1 or rng.random() < 0.2:
            continue
        room = min(k, scheduler.config.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens - 1)
        drafts = []
        for j in range(rng.randint(1, max(room, 1))):
            drafts.append(truth(request, j) if rng.random() < right else VOCAB + 1)
        request.spec_token_ids = drafts if room > 0 else []


def run(scheduler, reqs, drafting_seed=None, k=4):
    runner = FakeModelRunner(scheduler.kv_cache_manager.block_pool.num_blocks,
                             scheduler.kv_cache_manager.block_size, VOCAB)
    rng = random.Random(drafting_seed)
    for request in reqs:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished_requests():
        out, _ = schedule(scheduler)
        scheduler.update_from_output(out, runner.execute(out))
        check_state(scheduler)
        if drafting_seed is not None:
            propose(scheduler, rng, k)
        steps += 1
        assert steps < 5000
    check_drained(scheduler)
    return {r.request_id: r.output_token_ids for r in reqs}, steps


@pytest.mark.parametrize("seed,lookahead", [(0, 0), (1, 0), (2, 0), (3, 0), (0, 4), (1, 3)])
def test_outputs_equal_a_run_without_drafts_under_preemption_chunking_and_prefix_hits(
        seed, lookahead):
    """lookahead: a draft model's slots past each request's tokens (check_state holds
    every table to exactly that length, max_model_len capping it)."""
    # max_model_len cuts some requests short: drafts and lookahead stop at it.
    plain, plain_steps = run(make(num_spec_tokens=0, max_model_len=40), requests(seed))
    # A small pool (preemptions), a small budget (drafts cut, chunked prompts).
    tight = make(num_blocks=24, max_num_batched_tokens=10, max_num_seqs=4, lookahead=lookahead,
                 max_model_len=40)
    drafted, steps = run(tight, requests(seed), drafting_seed=seed)
    assert drafted == plain
    stats = tight.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert tight.num_preemptions_total > 0
    assert tight.kv_cache_manager.prefix_cache_stats.hits > 0
    roomy = make(lookahead=lookahead, max_model_len=40)
    assert run(roomy, requests(seed), drafting_seed=seed)[0] == plain
    assert sum(roomy.spec_stats.num_accepted_tokens_per_pos) == roomy.spec_stats.num_accepted_tokens


def state(scheduler, request):
    kv = scheduler.kv_cache_manager
    return (request.num_computed_tokens, list(request.all_token_ids),
            [len(t) for t in kv.req_to_block_ids[request.request_id]], kv.num_free_blocks,
            kv.num_cached_blocks[request.request_id], list(request.block_hashes),
            {h for cached in kv.block_pool.cached_by_group for h in cached})


@pytest.mark.parametrize("num_accepted", [0, 2])
def test_a_rejected_draft_leaves_blocks_and_hashes_as_if_never_proposed(num_accepted):
    """The draft crosses block boundaries; after verification the drafting scheduler
    holds what a twin holds after the same tokens decoded one at a time."""
    prompt = list(range(1, 8))  # 7 tokens, block_size 4: the prompt ends mid-block
    twins = [make(), make()]
    runners = [FakeModelRunner(200, 4, VOCAB) for _ in twins]
    reqs = [Request("r", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
            for _ in twins]
    for scheduler, runner, request in zip(twins, runners, reqs):
        scheduler.add_request(request)
        out, _ = schedule(scheduler)
        scheduler.update_from_output(out, runner.execute(out))
    drafting, plain = twins
    request = reqs[0]
    request.spec_token_ids = [truth(request, j) for j in range(num_accepted)] + [VOCAB + 1] * 6
    out, _ = schedule(drafting)
    assert out.num_scheduled_tokens["r"] == 1 + 6 + num_accepted
    # Positions 0 .. 14 + num_accepted - 1: 4 blocks; after it 2 or 3 are left.
    assert len(drafting.kv_cache_manager.req_to_block_ids["r"][0]) == 4
    drafting.update_from_output(out, runners[0].execute(out))
    assert request.num_output_tokens == 2 + num_accepted
    for _ in range(1 + num_accepted):  # the twin decodes the same tokens one by one
        out, _ = schedule(plain)
        plain.update_from_output(out, runners[1].execute(out))
    assert state(drafting, reqs[0]) == state(plain, reqs[1])
    check_state(drafting)


def test_the_token_budget_cuts_drafts_first():
    scheduler = make(max_num_batched_tokens=3)
    runner = FakeModelRunner(200, 4, VOCAB)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add_request(request)
    out, _ = schedule(scheduler)
    scheduler.update_from_output(out, runner.execute(out))
    request.spec_token_ids = [truth(request, j) for j in range(4)]
    out, _ = schedule(scheduler)
    assert out.num_scheduled_tokens["r"] == 3
    assert out.scheduled_spec_decode_tokens["r"] == [truth(request, 0), truth(request, 1)]
    scheduler.update_from_output(out, runner.execute(out))
    assert request.num_output_tokens == 4 and not request.spec_token_ids


def test_preemption_drops_the_draft():
    scheduler = make(num_blocks=5)
    runner = FakeModelRunner(5, 4, VOCAB)
    first, second = (Request(rid, [ord(rid)] * 7, SamplingParams(max_tokens=20,
                                                                         ignore_eos=True))
                     for rid in ("a", "b"))
    for request in (first, second):
        scheduler.add_request(request)
    out, _ = schedule(scheduler)
    scheduler.update_from_output(out, runner.execute(out))
    # Both hold 2 blocks; a 4-token draft needs 1 more for "a" and "b" needs 1 for its own.
    first.spec_token_ids = [VOCAB + 1] * 4
    second.spec_token_ids = [VOCAB + 1] * 4
    out, _ = schedule(scheduler)
    assert out.preempted_req_ids == {"b"}
    assert "b" not in out.scheduled_spec_decode_tokens and not second.spec_token_ids
    scheduler.update_from_output(out, runner.execute(out))
    check_state(scheduler)
