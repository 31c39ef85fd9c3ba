"""The scheduler's pooling rules without a model: a request finishes with its prompt's
last chunk, a prompt may fill max_model_len, and for encoders whole prompts only (the
first that does not fit the step's budget waits, vLLM's rule without chunked prefill)."""
import pytest

from engine import CacheConfig, Request, RequestStatus, SchedulerConfig
from engine.pooling.scheduler import PoolingScheduler


def make(whole_prompts=False, budget=10, max_model_len=10, blocks=64, **sched):
    return PoolingScheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len, **sched),
        CacheConfig(block_size=4, num_kv_blocks=blocks, enable_prefix_caching=False),
        whole_prompts=whole_prompts)


def run_step(scheduler):
    out = scheduler.schedule()
    done = scheduler.finish_pooled(out)
    return out, done


def test_whole_prompts_wait_for_a_step_that_fits_them():
    scheduler = make(whole_prompts=True)
    for rid, n in (("a", 6), ("b", 6), ("c", 3)):
        scheduler.add_request(Request(rid, list(range(1, n + 1))))
    out, done = run_step(scheduler)
    # b does not fit whole in the 4 tokens left, and c waits behind it (queue order).
    assert out.num_scheduled_tokens == {"a": 6} and [r.request_id for r in done] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.waiting.peek().status == RequestStatus.WAITING
    out, done = run_step(scheduler)
    assert out.num_scheduled_tokens == {"b": 6, "c": 3}
    assert {r.request_id for r in done} == {"b", "c"}
    assert all(r.status == RequestStatus.FINISHED_STOPPED for r in done)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert scheduler.get_stats().prefix_cache_queries == 15  # each prompt looked up once


def test_chunked_requests_finish_with_their_last_chunk_and_free_their_blocks():
    scheduler = make(budget=4)
    scheduler.add_request(Request("a", list(range(1, 11))))
    steps = []
    while scheduler.has_unfinished_requests():
        out, done = run_step(scheduler)
        steps.append((out.num_scheduled_tokens["a"], [r.request_id for r in done]))
    assert steps == [(4, []), (4, []), (2, ["a"])]
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert scheduler.generation_tokens_total == 0


def test_a_prompt_may_fill_max_model_len():
    scheduler = make()
    scheduler.add_request(Request("full", list(range(1, 11))))
    with pytest.raises(ValueError, match="prompt has 11 tokens, more than max_model_len=10"):
        scheduler.add_request(Request("over", list(range(1, 12))))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("full", [1]))


def test_whole_prompts_need_a_budget_of_max_model_len():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) is smaller than "
                                         r"max_model_len \(10\)"):
        make(whole_prompts=True, budget=8)
    with pytest.raises(ValueError, match="max_num_partial_prefills: an encoder"):
        make(whole_prompts=True, max_num_partial_prefills=2)
