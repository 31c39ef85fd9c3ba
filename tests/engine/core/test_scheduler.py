"""Hand-checked scenarios for each scheduling rule, and the prefix cache as the scheduler
uses it. The KV manager's and the stop checker's own rules: kv_cache/test_manager.py,
test_stop_checker.py."""
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from testing.fake_model import FakeModelRunner, run_to_completion
from testing.sched_invariants import check_drained, check_state, check_step, schedule


def make(num_blocks=1000, block_size=16, watermark=0.0, caching=True, **sched):
    sched.setdefault("max_model_len", 2048)
    return Scheduler(SchedulerConfig(**sched),
                     CacheConfig(num_kv_blocks=num_blocks, block_size=block_size,
                                 watermark=watermark, enable_prefix_caching=caching))


def req(rid, prompt, max_tokens=16, priority=0, arrival=None, eos=None, **params):
    if isinstance(prompt, int):
        prompt = [(hash(rid) + i) % 30000 + 1 for i in range(prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   priority=priority, arrival_time=arrival, eos_token_id=eos)


def step(s, sampled=None):
    """One schedule + update; returns (output, finished requests, StepIds)."""
    out, ids = schedule(s)
    if sampled is None:
        sampled = {r.request_id: [7] for r in out.scheduled_requests
                   if r.num_computed_tokens >= r.num_tokens}
    finished = [r for r in s.update_from_output(out, sampled) if r.is_finished]
    check_state(s)
    return out, finished, ids


def test_chunked_prefill_budget_and_threshold():
    s = make(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for name in "abc":
        s.add_request(req(name, 800))
    out, _, ids = step(s)
    assert out.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    assert ids.new == ["a", "b", "c"]
    out, _, ids = step(s)
    assert out.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    out, _, ids = step(s)
    # a and b finished their prompts last step and now decode; c gets the rest.
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 352}
    assert [r.num_output_tokens for r in (s.requests["a"], s.requests["b"])] == [2, 2]


def test_decodes_mix_with_a_long_prefill_and_running_goes_first():
    s = make(max_num_batched_tokens=64)
    s.add_request(req("short", 10))
    step(s)
    s.add_request(req("long", 300))
    out, _, ids = step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 63}
    assert ids.running == ["short"] and ids.new == ["long"]


def test_max_num_seqs_caps_admissions():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 5))
    out, _, ids = step(s)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_max_model_len_caps_length():
    s = make(max_model_len=20)
    s.add_request(req("r", 15, max_tokens=100))
    finished = []
    while s.has_unfinished_requests():
        finished += step(s)[1]
    (r,) = finished
    assert r.num_tokens == 20 and r.finish_reason == "length"
    check_drained(s)


def test_prompt_at_max_model_len_is_rejected():
    s = make(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(req("r", 16))


def test_prefix_cache_hit_and_last_token_always_computed():
    s = make(block_size=16)
    shared = list(range(1, 49))  # three full blocks
    s.add_request(req("a", shared + [100, 101]))
    step(s)
    s.add_request(req("b", shared + [200]))
    out, _, ids = step(s)
    assert out.num_scheduled_tokens["b"] == 1  # 48 tokens came from the cache
    kv = s.kv_cache_manager
    assert kv.req_to_block_ids["a"][0][:3] == kv.req_to_block_ids["b"][0][:3]
    assert kv.prefix_cache_stats.queries == 50 + 49
    assert kv.prefix_cache_stats.hits == 48
    # A prompt that is exactly cached still computes its last token.
    s.add_request(req("c", shared))
    out, _, ids = step(s)
    assert out.num_scheduled_tokens["c"] == 16 and s.requests["c"].num_cached_tokens == 32


def test_cache_salt_separates_prefixes():
    s = make(block_size=4)
    s.add_request(Request("a", list(range(1, 10)), SamplingParams(max_tokens=1), cache_salt="x"))
    step(s)
    s.add_request(Request("b", list(range(1, 10)), SamplingParams(max_tokens=1), cache_salt="y"))
    out, _, ids = step(s)
    assert out.num_scheduled_tokens["b"] == 9


def test_watermark_holds_back_admissions_but_not_running_growth():
    s = make(num_blocks=10, block_size=4, watermark=0.2)  # 2 blocks reserved
    s.add_request(req("big", 33))  # 9 blocks: 10 - 9 < 2
    out, _, ids = step(s)
    assert not out.num_scheduled_tokens and len(s.waiting) == 1
    s.finish_requests(["big"])
    s.add_request(req("ok", 32, max_tokens=8))  # 8 blocks: 10 - 8 >= 2
    out, _, ids = step(s)
    assert out.num_scheduled_tokens == {"ok": 32}
    step(s)  # the decode needs a 9th block: running requests may use the reserve
    assert len(s.kv_cache_manager.req_to_blocks["ok"][0]) == 9


def test_fcfs_preempts_tail_and_resumes_first():
    s = make(num_blocks=4, block_size=4, caching=False)
    s.add_request(req("a", 8, max_tokens=20, ignore_eos=True))
    s.add_request(req("b", 8, max_tokens=20, ignore_eos=True))
    step(s)  # a, b: 2 blocks each, pool full
    s.add_request(req("c", 3))
    out, _, ids = step(s)  # both need a third block at position 8
    assert ids.preempted == ["b"]
    assert out.num_scheduled_tokens == {"a": 1} and not ids.new
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions_total == 1
    assert s.waiting.peek() is b and b.num_output_tokens == 1


def test_preempted_req_ids_name_a_request_in_the_step_that_preempted_it_only():
    """vLLM's meaning: the ids preempted in this very step, so the runner drops their
    state; empty in the steps without a preemption, whether the victim still waits or
    has been readmitted (it comes back as a resumed request, not as preempted)."""
    s = make(num_blocks=4, block_size=4, caching=False)
    s.add_request(req("a", 8, max_tokens=6, ignore_eos=True))
    s.add_request(req("b", 8, max_tokens=2, ignore_eos=True))
    steps = []
    while s.has_unfinished_requests():
        out, _, ids = step(s)
        steps.append((set(out.preempted_req_ids), ids))
    # Step 1: a's first decode needs a third block and evicts b. b cannot come back until
    # a has finished and freed its four blocks.
    assert [preempted for preempted, _ in steps] == [set(), {"b"}] + [set()] * (len(steps) - 2)
    resumed_at = [i for i, (_, ids) in enumerate(steps) if ids.resumed]
    assert resumed_at == [len(steps) - 1] and steps[-1][1].resumed == ["b"]
    assert len(steps) > 3 and s.num_preemptions_total == 1
    check_drained(s)


def test_priority_preempts_lowest_priority_not_tail():
    s = make(num_blocks=4, block_size=4, caching=False, policy="priority")
    s.add_request(req("low", 8, max_tokens=20, priority=5, arrival=1.0, ignore_eos=True))
    s.add_request(req("high", 8, max_tokens=20, priority=0, arrival=2.0, ignore_eos=True))
    out, _, ids = step(s)
    assert ids.new == ["high", "low"]  # priority order, not arrival
    out, _, ids = step(s)
    assert ids.preempted == ["low"]
    assert out.num_scheduled_tokens == {"high": 1}


def test_priority_victim_already_scheduled_gives_back_its_budget():
    s = make(num_blocks=5, block_size=4, caching=False, policy="priority")
    s.add_request(req("low", 7, max_tokens=20, priority=9, arrival=0.0, ignore_eos=True))
    step(s)
    s.add_request(req("high", 8, max_tokens=20, priority=0, arrival=1.0, ignore_eos=True))
    step(s)  # running order: low, high; 2 + 2 blocks, 1 free
    assert [r.request_id for r in s.running] == ["low", "high"]
    out, _, ids = step(s)  # low grows into the free block, then high needs one: low is evicted
    assert ids.preempted == ["low"]
    assert out.num_scheduled_tokens == {"high": 1} and out.total_num_scheduled_tokens == 1


def test_priority_queue_orders_waiting():
    s = make(max_num_seqs=1, policy="priority")
    s.add_request(req("late-urgent", 3, priority=0, arrival=5.0))
    s.add_request(req("early-lazy", 3, priority=3, arrival=1.0))
    s.add_request(req("early-urgent", 3, priority=0, arrival=2.0))
    assert [r.request_id for r in s.waiting] == ["early-urgent", "late-urgent", "early-lazy"]


def test_abort_waiting_and_running_frees_everything():
    s = make(max_num_seqs=1)
    s.add_request(req("run", 40))
    s.add_request(req("wait", 40))
    step(s)
    assert s.kv_cache_manager.usage > 0
    aborted = s.finish_requests(["run", "wait", "unknown"])
    assert {r.request_id for r in aborted} == {"run", "wait"}
    assert all(r.finish_reason == "abort" for r in aborted)
    check_drained(s)
    assert s.schedule().finished_req_ids == {"run", "wait"}


def test_preempted_request_resumes_from_prefix_cache_and_output_matches():
    def run(num_blocks):
        s = make(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
        runner = FakeModelRunner(num_blocks, 4)
        for i in range(6):
            s.add_request(req(f"r{i}", 10 + i, max_tokens=25, ignore_eos=True))
        done = {}
        while s.has_unfinished_requests():
            out = s.schedule()
            check_step(s, out)
            for r in s.update_from_output(out, runner.execute(out)):
                done[r.request_id] = r
        check_drained(s)
        return s, {k: r.output_token_ids for k, r in done.items()}

    roomy, expected = run(200)
    tight, got = run(24)
    assert roomy.num_preemptions_total == 0 and tight.num_preemptions_total > 0
    assert got == expected
    assert tight.kv_cache_manager.prefix_cache_stats.hits > 0


def test_duplicate_request_id_rejected():
    s = make()
    s.add_request(req("r", 5))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("r", 5))


def test_run_to_completion_with_fake_model():
    s = make(num_blocks=30, block_size=4, max_num_batched_tokens=40, long_prefill_token_threshold=12)
    for i in range(20):
        s.add_request(req(f"r{i}", 5 + 3 * i, max_tokens=10))
    run_to_completion(s, FakeModelRunner(30, 4), on_step=check_step)
    check_drained(s)


def test_priority_victim_preempted_after_its_grant_is_undone_cleanly():
    s = make(num_blocks=7, block_size=1, policy="priority")
    s.add_request(req("low", [11, 12, 13], max_tokens=20, priority=9, arrival=0.0, ignore_eos=True))
    step(s)
    s.add_request(req("high", [21, 22], max_tokens=20, priority=0, arrival=1.0, ignore_eos=True))
    step(s)
    out, ids = schedule(s)  # low takes the last block, then high needs one and low is evicted
    assert ids.preempted == ["low"] and out.num_scheduled_tokens == {"high": 1}
    low = s.requests["low"]
    assert low.num_computed_tokens == 0
    # low's token at position 4 was never computed: its hash must not be served.
    assert low.block_hashes[4] not in s.kv_cache_manager.block_pool.cached_blocks


def test_partial_prefill_limits_let_short_prompts_start_behind_long_ones():
    """Two 500-token prompts ahead of two 10-token ones, 64 tokens a step. Without
    limits the long ones take every step's budget and the short ones start after them;
    with 2 prefills a step, 1 of them long, each prefill gets 32 tokens, the second long
    prompt waits its turn and the short ones start at once."""
    def first_token_steps(**limits):
        s = make(max_num_batched_tokens=64, **limits)
        requests = [req(name, length, max_tokens=4) for name, length in
                    (("long1", 500), ("long2", 500), ("short1", 10), ("short2", 10))]
        for r in requests:
            s.add_request(r)
        first, steps = {}, 0
        while s.has_unfinished_requests():
            out, _, _ = step(s)
            steps += 1
            for r in requests:
                if r.num_output_tokens:
                    first.setdefault(r.request_id, steps)
            if limits:
                prefills = [r for r in out.scheduled_requests
                            if out.num_scheduled_tokens[r.request_id] > 1]
                assert len(prefills) <= 2
                assert all(out.num_scheduled_tokens[r.request_id] <= 32 for r in prefills)
        return first

    plain = first_token_steps()
    assert plain["short1"] >= 15 and plain["short2"] >= 15  # after ~1,000 prompt tokens
    limited = first_token_steps(max_num_partial_prefills=2, max_long_partial_prefills=1)
    assert limited["short1"] == 1 and limited["short2"] == 2
    assert limited["long1"] < limited["long2"]  # the long ones keep their order


def test_partial_prefill_limits_are_validated():
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=1, max_long_partial_prefills=2)
    with pytest.raises(ValueError, match="needs max_num_partial_prefills"):
        SchedulerConfig(max_long_partial_prefills=1)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=-1)


def test_shield_resumed_ends_the_evict_at_every_chunk_thrash():
    """vllm#25538: two long-running requests fill the pool; a late prompt is readmitted
    with room for one chunk and, as the latest admitted, evicts itself at its next one,
    again and again until the others finish. Shielded for k steps after its k-th
    readmission, it evicts another request instead and gets going. Outputs are the same."""
    def run(shield):
        s = make(num_blocks=64, block_size=4, max_num_batched_tokens=8, max_model_len=256,
                 caching=False, shield_resumed=shield)
        runner = FakeModelRunner(64, 4)
        for name in ("a", "b"):
            s.add_request(req(name, 60, max_tokens=100, ignore_eos=True))
        late = req("late", 32, max_tokens=4, ignore_eos=True)
        first_token, outputs, steps = None, {}, 0
        while s.has_unfinished_requests() or steps < 60:
            if steps == 60:
                s.add_request(late)
            out = s.schedule()
            steps += 1
            sampled = runner.execute(out)
            if "late" in sampled and first_token is None:
                first_token = steps - 60
            for r in s.update_from_output(out, sampled):
                outputs[r.request_id] = list(r.output_token_ids)
            check_state(s)
        return first_token, late.num_preemptions, outputs

    old_first, old_preemptions, old_outputs = run(False)
    first, preemptions, outputs = run(True)
    assert old_first > 50 and old_preemptions >= 5  # stuck until a and b are done
    assert first < 20 and preemptions <= 2
    assert outputs == old_outputs
