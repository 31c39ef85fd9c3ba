"""Property tests: random workloads through the real scheduler and a fake model."""
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from testing.fake_model import FakeModelRunner
from testing.sched_invariants import check_drained, schedule

EOS = 0


@st.composite
def workloads(draw, allow_aborts=True, admission=None):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(16, 96))
    watermark = draw(st.sampled_from([0.0, 0.0, 0.05, 0.2]))
    # The pool always fits one max-length request besides the watermark's reserve, as the
    # engine enforces at start-up (else a long prompt could never be admitted).
    needed = -(-max_model_len // block_size)
    least = needed
    while least - int(watermark * least) < needed:
        least += 1
    num_blocks = draw(st.integers(least, max(least, 3 * max_model_len // block_size + 4)))
    partial = draw(st.sampled_from([0, 0, 1, 2, 3]))
    sched = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(1, 128)),
        max_num_seqs=draw(st.integers(1, 12)),
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 5, 17])),
        max_num_partial_prefills=partial,
        max_long_partial_prefills=draw(st.integers(0, partial)),
        shield_resumed=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority", "fair"])),
        tenant_weights=draw(st.sampled_from([None, {"a": 3.0}])),
        admission=admission or draw(st.sampled_from(["max_utilization", "no_evict"])))
    cache = CacheConfig(num_kv_blocks=num_blocks, block_size=block_size,
                        enable_prefix_caching=draw(st.booleans()),
                        watermark=watermark)
    shared_prefix = draw(st.lists(st.integers(1, 50), max_size=40))
    requests = []
    for i in range(draw(st.integers(1, 25))):
        plen = draw(st.integers(1, max_model_len - 1))
        use_prefix = draw(st.booleans())
        prompt = (shared_prefix + draw(st.lists(st.integers(1, 999), min_size=plen, max_size=plen)))
        prompt = (prompt if use_prefix else prompt[len(shared_prefix):])[:max_model_len - 1]
        params = SamplingParams(max_tokens=draw(st.integers(1, 40)),
                                ignore_eos=draw(st.booleans()),
                                min_tokens=draw(st.integers(0, 1)))
        requests.append(dict(prompt=prompt, params=params, priority=draw(st.integers(0, 3)),
                             arrive_at_step=draw(st.integers(0, 30)),
                             tenant=draw(st.sampled_from([None, "a", "b"])),
                             abort_at_step=(draw(st.one_of(st.none(), st.integers(0, 60)))
                                            if allow_aborts else None)))
    return sched, cache, requests


def drive(sched, cache, specs, check=True, max_steps=20_000, enable_kv_events=False,
          before_schedule=None, after_step=None):
    """Runs the workload to the end. Hooks: before_schedule(scheduler) ahead of each
    schedule(), after_step(scheduler, step) after each update_from_output()."""
    s = Scheduler(sched, cache, enable_kv_events=enable_kv_events)
    runner = FakeModelRunner(cache.num_kv_blocks, cache.block_size)
    finished, step = {}, 0
    pending = sorted(range(len(specs)), key=lambda i: specs[i]["arrive_at_step"])
    aborts = {}
    while pending or s.has_unfinished_requests():
        while pending and specs[pending[0]]["arrive_at_step"] <= step:
            i = pending.pop(0)
            spec = specs[i]
            s.add_request(Request(f"r{i}", spec["prompt"], spec["params"], priority=spec["priority"],
                                  arrival_time=float(i), eos_token_id=EOS,
                                  tenant=spec.get("tenant")))
            if spec["abort_at_step"] is not None:
                aborts.setdefault(step + spec["abort_at_step"], []).append(f"r{i}")
        for r in s.finish_requests(aborts.pop(step, [])):
            finished[r.request_id] = r
        if before_schedule is not None:
            before_schedule(s)
        out = schedule(s)[0] if check else s.schedule()
        for r in s.update_from_output(out, runner.execute(out)):
            if r.is_finished:
                finished[r.request_id] = r
        if after_step is not None:
            after_step(s, step)
        step += 1
        assert step < max_steps, "no progress"
    check_drained(s)
    assert set(finished) == {f"r{i}" for i in range(len(specs))}, "a request was lost"
    return s, finished


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_finish(workload):
    sched, cache, specs = workload
    _, finished = drive(sched, cache, specs)
    for rid, r in finished.items():
        assert r.is_finished
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens or r.num_tokens == sched.max_model_len
        assert r.num_output_tokens <= r.max_tokens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(allow_aborts=False))
def test_outputs_do_not_depend_on_pool_size_chunking_or_caching(workload):
    sched, cache, specs = workload
    _, small = drive(sched, cache, specs)
    # fcfs and max_utilization: the other policies and admission must not change outputs.
    roomy_sched = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64,
                                  max_model_len=sched.max_model_len)
    roomy_cache = CacheConfig(num_kv_blocks=4096, block_size=cache.block_size,
                              enable_prefix_caching=False)
    _, big = drive(roomy_sched, roomy_cache, specs)
    assert {k: r.output_token_ids for k, r in small.items()} == {
        k: r.output_token_ids for k, r in big.items()}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(admission="no_evict"))
def test_no_evict_never_preempts_and_always_finishes(workload):
    sched, cache, specs = workload
    # drive() fails on a lost request or a run that stops making progress (a deadlock).
    s, _ = drive(sched, cache, specs)
    assert s.num_preemptions_total == 0


def test_long_run_ten_thousand_requests_through_a_small_pool():
    rng = random.Random(1234)
    sched = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32, max_model_len=128,
                            long_prefill_token_threshold=48)
    cache = CacheConfig(num_kv_blocks=64, block_size=8)
    system_prompts = [[rng.randrange(1, 999) for _ in range(rng.randrange(8, 40))] for _ in range(5)]
    specs = []
    for i in range(10_000):
        prompt = [rng.randrange(1, 999) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.5:
            prompt = rng.choice(system_prompts) + prompt
        specs.append(dict(prompt=prompt, params=SamplingParams(max_tokens=rng.randrange(1, 60)),
                          priority=0, arrive_at_step=i // 8,
                          abort_at_step=rng.randrange(0, 30) if rng.random() < 0.05 else None))
    s, finished = drive(sched, cache, specs, check=False, max_steps=500_000)
    assert len(finished) == 10_000
    assert s.num_preemptions_total > 100
    assert s.kv_cache_manager.prefix_cache_stats.hits > 0
