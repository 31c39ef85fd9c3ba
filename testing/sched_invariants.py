"""Whole-state invariants of the scheduler and its KV manager, checked after a step."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.core.kv_cache.block_pool import NULL_BLOCK
from engine.core.request import RequestStatus
from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import Scheduler


@dataclass
class StepIds:
    """Who a schedule() call admitted, resumed, kept and preempted, read off the state
    before and after it, not from the output it checks."""
    new: list[str]
    resumed: list[str]
    running: list[str]
    preempted: list[str]


def schedule(scheduler: Scheduler) -> tuple[SchedulerOutput, StepIds]:
    """schedule() and the ids of what it did, with the step invariants checked."""
    status_before = {rid: r.status for rid, r in scheduler.requests.items()}
    running_before = [r.request_id for r in scheduler.running]
    out = scheduler.schedule()
    scheduled = [r.request_id for r in out.scheduled_requests]
    preempted = [rid for rid in running_before
                 if scheduler.requests[rid].status == RequestStatus.PREEMPTED]
    ids = StepIds(
        new=[rid for rid in scheduled if status_before[rid] == RequestStatus.WAITING],
        resumed=[rid for rid in scheduled if status_before[rid] == RequestStatus.PREEMPTED],
        running=[rid for rid in scheduled if status_before[rid] == RequestStatus.RUNNING],
        preempted=preempted)
    check_step(scheduler, out, ids)
    return out, ids


def check_step(scheduler: Scheduler, out: SchedulerOutput, ids: StepIds | None = None) -> None:
    cfg = scheduler.config
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled_requests) <= cfg.max_num_seqs
    assert len(scheduler.running) <= cfg.max_num_seqs
    if cfg.long_prefill_token_threshold > 0:
        assert max(out.num_scheduled_tokens.values(), default=0) <= cfg.long_prefill_token_threshold
    if ids is not None:
        # vLLM's meaning: preempted in this very step, not before it and not since the
        # request came back.
        assert out.preempted_req_ids == set(ids.preempted)
        if ids.preempted:
            assert not ids.new and not ids.resumed, "admitted while preempting"
    assert not out.preempted_req_ids & out.num_scheduled_tokens.keys(), "preempted yet scheduled"
    for request in out.scheduled_requests:
        # Copies of the block tables, not the KV manager's own lists.
        tables = out.block_ids[request.request_id]
        own = scheduler.kv_cache_manager.req_to_block_ids[request.request_id]
        assert tables == own
        assert all(t is not o for t, o in zip(tables, own))
    assert all(n > 0 for n in out.num_scheduled_tokens.values())
    check_state(scheduler)


def check_state(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    owners: Counter[int] = Counter()
    bs = kv.block_size
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        for blocks, block_ids in zip(kv.req_to_blocks[request.request_id],
                                     kv.req_to_block_ids[request.request_id], strict=True):
            assert [b.block_id for b in blocks] == block_ids
            held = [b.block_id for b in blocks if b is not NULL_BLOCK]
            assert len(set(held)) == len(held), "a block appears twice in one block table"
            # Plus the lookahead slots a draft model writes to (speculative decoding).
            computed = request.num_computed_tokens
            assert len(blocks) == -(-(computed + scheduler.lookahead_slots(computed)) // bs)
            owners.update(held)
        # Scheduled drafts (speculative decoding) count as computed until verified.
        assert request.num_computed_tokens <= request.num_tokens + len(request.spec_token_ids)
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0
        assert request.request_id not in kv.req_to_blocks
    assert set(kv.req_to_blocks) == {r.request_id for r in scheduler.running}
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"{block} has {owners[block.block_id]} owners"
        assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue)
    for group, cached in enumerate(pool.cached_by_group):
        for block_hash, block in cached.items():
            assert block.block_hash == block_hash and block.group == group
    assert len(scheduler.requests) == len(scheduler.running) + len(scheduler.waiting)


def check_drained(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.requests
    assert kv.num_free_blocks == kv.block_pool.num_blocks, "blocks leaked"
    assert kv.usage == 0.0
    assert not kv.req_to_blocks
