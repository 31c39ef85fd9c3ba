"""Property tests: random workloads through the real scheduler and a fake model."""
import dataclasses
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.core.preemption import ANCHOR_PREEMPTIONS
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from testing.fake_model import FakeModelRunner
from testing.sched_invariants import check_drained, schedule

EOS = 0


def examples(share: float) -> int:
    """`share` of the hypothesis profile's max_examples (tests/conftest.py: 100 under "ci",
    1000 under "explore"), so these tests explore further when the profile asks them to."""
    return max(1, round(share * settings.default.max_examples))


@st.composite
def workloads(draw, allow_aborts=True, admission=None, policy=None, shield_resumed=None):
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
        shield_resumed=draw(st.booleans()) if shield_resumed is None else shield_resumed,
        policy=policy or draw(st.sampled_from(["fcfs", "priority", "fair"])),
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


@settings(max_examples=examples(1.5), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_finish(workload):
    sched, cache, specs = workload
    _, finished = drive(sched, cache, specs)
    for rid, r in finished.items():
        assert r.is_finished
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens or r.num_tokens == sched.max_model_len
        assert r.num_output_tokens <= r.max_tokens


def spec(prompt_len, max_tokens, arrive_at_step, tenant=None):
    return dict(prompt=[(7 * i) % 900 + 1 for i in range(prompt_len)],
                params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=0,
                arrive_at_step=arrive_at_step, tenant=tenant, abort_at_step=None)


# Found by hypothesis: two tenants whose requests need 87 blocks of a 52-block pool took it
# from each other in turn, each preemption evicting the one whose counter was ahead, and the
# run never ended (the progress rule, engine/core/scheduler.py, ends it).
TWO_TENANTS_TRADING_THE_POOL = (
    SchedulerConfig(max_num_batched_tokens=52, max_num_seqs=6, max_model_len=52,
                    long_prefill_token_threshold=1, shield_resumed=True, policy="fair"),
    CacheConfig(block_size=1, num_kv_blocks=52, enable_prefix_caching=False),
    [spec(31, 36, arrive_at_step=0), spec(16, 19, arrive_at_step=3, tenant="b")])


@settings(max_examples=examples(0.6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(allow_aborts=False))
@example(TWO_TENANTS_TRADING_THE_POOL)
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


@settings(max_examples=examples(0.3), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(admission="no_evict"))
def test_no_evict_never_preempts_and_always_finishes(workload):
    sched, cache, specs = workload
    # drive() fails on a lost request or a run that stops making progress (a deadlock).
    s, _ = drive(sched, cache, specs)
    assert s.num_preemptions_total == 0


def progress_bound(sched, specs):
    """Steps within which a workload without aborts ends, when each request alone fits the
    pool (the workloads() strategy sees to that). Steps up to the last arrival, plus:
    - fcfs, or admission="no_evict" (which never preempts): `work`, the tokens the requests
      have at most. Every busy step the first running request, never a victim, computes a
      token it keeps, and it stays first until it finishes.
    - fair (the progress rule in engine/core/scheduler.py): `work`, plus L + 1 steps for each
      of the at most n * K preemptions made while no anchor exists (the tokens one takes back
      and its step), plus L steps of lost work per request per anchor (the anchor phase may
      take back what it computed before), plus (2S + 1)(L + 1) steps per anchor: waiting, it
      gets in once RUNNING, which does not grow meanwhile, is done or evicted (S(L + 1));
      then those admitted before it go the same way ((S - 1)(L + 1)); then it runs, a token
      a step (L + 1).
    - priority: the most deserving request plays the anchor's part (it is first in WAITING
      and never a victim), which gives a smaller bound than fair's; the look-ahead of
      partial prefills, which can start others past it, is left out of that argument and
      checked here only.
    n requests, L = max_model_len, S = max_num_seqs, K = ANCHOR_PREEMPTIONS."""
    n, big_l, seats = len(specs), sched.max_model_len, sched.max_num_seqs
    last = max(s["arrive_at_step"] for s in specs)
    work = sum(min(len(s["prompt"]) + s["params"].max_tokens, big_l) for s in specs)
    if sched.policy == "fcfs" or sched.admission == "no_evict":
        return last + 1 + work
    return (last + 1 + work + n * (big_l + 1) * ANCHOR_PREEMPTIONS + n * n * big_l
            + n * (2 * seats + 1) * (big_l + 1))


@pytest.mark.parametrize("shield_resumed", [False, True], ids=["unshielded", "shielded"])
@pytest.mark.parametrize("policy, admission", [
    ("fcfs", "max_utilization"), ("priority", "max_utilization"),
    ("fair", "max_utilization"), (None, "no_evict")])
@settings(max_examples=examples(0.25), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(allow_aborts=False))
@example(workload=TWO_TENANTS_TRADING_THE_POOL)
def test_every_request_finishes_within_the_progress_bound(policy, admission, shield_resumed,
                                                          workload):
    """No livelock under any policy: every request of a workload whose requests each fit
    the pool alone finishes, within progress_bound() steps. The workload's own policy and
    admission give way to the case's (policy None: the drawn one)."""
    sched, cache, specs = workload
    sched = dataclasses.replace(sched, policy=policy or sched.policy, admission=admission,
                                shield_resumed=shield_resumed)
    bound = progress_bound(sched, specs)
    # check=False: the invariants are the other tests' job; a livelock fails faster without.
    s, finished = drive(sched, cache, specs, check=False, max_steps=bound + 1)
    assert all(r.is_finished and r.finish_reason != "abort" for r in finished.values())


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
