"""admission="no_evict" (engine/core/admission.py) in hand-checked cases; the random
workloads are in test_scheduler_properties.py."""
from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from testing.fake_model import FakeModelRunner
from testing.sched_invariants import check_drained, schedule


def run(admission, specs, num_blocks=10, caching=True):
    """specs: (request id, prompt, max_tokens, arrival step). Returns (first scheduled
    step per request, outputs, scheduler)."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=128,
                                  admission=admission),
                  CacheConfig(num_kv_blocks=num_blocks, block_size=16,
                              enable_prefix_caching=caching))
    runner = FakeModelRunner(num_blocks, 16)
    started, outputs, step = {}, {}, 0
    while step <= max(spec[3] for spec in specs) or s.has_unfinished_requests():
        for rid, prompt, max_tokens, at in specs:
            if at == step:
                s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                                  ignore_eos=True)))
        out, ids = schedule(s)
        for rid in ids.new:
            started[rid] = step
        for r in s.update_from_output(out, runner.execute(out)):
            if r.is_finished:
                outputs[r.request_id] = r.output_token_ids
        step += 1
        assert step < 5000
    check_drained(s)
    return started, outputs, s


def test_head_of_line_waits_for_the_worst_case_instead_of_being_preempted_later():
    # Each needs 16 + 100 tokens = 8 blocks at its worst; the pool has 10.
    specs = [("a", list(range(1, 17)), 100, 0), ("b", list(range(101, 117)), 100, 1)]
    eager_start, eager_out, eager = run("max_utilization", specs)
    safe_start, safe_out, safe = run("no_evict", specs)
    assert eager_start["b"] == 1 and eager.num_preemptions_total > 0
    assert safe_start["b"] > 90 and safe.num_preemptions_total == 0  # after a finished
    assert safe_out == eager_out


def test_shared_prefix_blocks_are_counted_once():
    # 96 shared prompt tokens (6 full blocks) + 1 own token, max_tokens 15: 7 blocks alone,
    # but the second needs only its own last block beside the first: 8 of the 8 blocks.
    shared = list(range(1, 97))
    specs = [("a", shared + [500], 15, 0), ("b", shared + [600], 15, 1)]
    started, _, s = run("no_evict", specs, num_blocks=8)
    assert started["b"] == 1 and s.num_preemptions_total == 0
    started, _, _ = run("no_evict", specs, num_blocks=8, caching=False)
    assert started["b"] > 10  # without the cache, 14 blocks: b waits for a
