"""policy="fair" (VTC, engine/core/fair_share.py) with a fake model: a tenant flooding the
engine with 10x the load of another."""
import itertools
import statistics

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.fair_queue import FairQueue
from engine.core.fair_share import VirtualTokenCounter
from engine.core.preemption import ANCHOR_PREEMPTIONS
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from testing.fake_model import FakeModelRunner
from testing.sched_invariants import check_drained, schedule
from tests.engine.core.test_scheduler_properties import TWO_TENANTS_TRADING_THE_POOL, spec

MAX_MODEL_LEN = 512
_IDS = itertools.count()


def make(policy, seqs=16, budget=128, blocks=600, **sched):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                     max_model_len=MAX_MODEL_LEN, policy=policy, **sched),
                     CacheConfig(num_kv_blocks=blocks, block_size=16))


def request(rid, tenant, prompt_len, max_tokens, arrival):
    # Its own first token: no two prompts share a block, run after run.
    prompt = [next(_IDS) + 1000] + [(7 * i) % 900 + 1 for i in range(prompt_len - 1)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=float(arrival), tenant=tenant)


def drive(s, arrivals, on_step=None):
    """arrivals: step -> requests. Runs to the end with the step invariants checked;
    returns (first-token step per request id, outputs per request id)."""
    runner = FakeModelRunner(s.cache_config.num_kv_blocks, s.cache_config.block_size)
    first, outputs, step = {}, {}, 0
    last = max(arrivals)
    while step <= last or s.has_unfinished_requests():
        for r in arrivals.get(step, ()):
            s.add_request(r)
        out = schedule(s)[0]
        if on_step is not None:
            on_step(s, out)
        for r in s.update_from_output(out, runner.execute(out)):
            first.setdefault(r.request_id, step + 1)
            if r.is_finished:
                outputs[r.request_id] = r.output_token_ids
        step += 1
        assert step < 20_000
    check_drained(s)
    return first, outputs


def flood(tenants, steps=80):
    """light: a 384-token prompt every 10 steps; heavy: 10x its tokens (5 requests of 80
    tokens a step). 16 seats and 128 tokens a step serve light alone at once, not both."""
    arrivals = {}
    for step in range(steps):
        batch = []
        if "heavy" in tenants:
            batch += [request(f"h{step}.{i}", "heavy", 64, 16, step) for i in range(5)]
        if "light" in tenants and step % 10 == 0:
            batch.append(request(f"l{step}", "light", 384, 16, step))
        arrivals[step] = batch
    return arrivals


def light_ttft(first, arrivals):
    return statistics.mean(first[r.request_id] - r.arrival_time
                           for batch in arrivals.values() for r in batch if r.tenant == "light")


def test_light_tenant_ttft_stays_near_alone_under_fair_not_fcfs():
    alone = light_ttft(drive(make("fcfs"), flood({"light"}))[0], flood({"light"}))
    both = flood({"light", "heavy"})
    fcfs_first, fcfs_out = drive(make("fcfs"), both)
    both = flood({"light", "heavy"})
    fair_first, fair_out = drive(make("fair"), both)
    fair = light_ttft(fair_first, both)
    fcfs = light_ttft(fcfs_first, both)
    assert fair <= 1.5 * alone, (alone, fair)
    assert fcfs > 5 * alone, (alone, fcfs)  # waits behind the flood
    assert fair_out == fcfs_out  # scheduling changes when, never what


def weighted_service(s, out, served, prefill_weight=1.0, decode_weight=2.0):
    """Service per tenant as the VTC paper counts it, read off the step's output (before
    the step is computed, num_computed_tokens already counts what it scheduled)."""
    for r in out.scheduled_requests:
        n = out.num_scheduled_tokens[r.request_id]
        start = r.num_computed_tokens - n
        prefill = max(0, min(r.num_prompt_tokens, start + n) - start)
        served[r.tenant] = served.get(r.tenant, 0.0) + (
            prefill * prefill_weight + (n - prefill) * decode_weight)


def service_gap(policy):
    """Largest |W_heavy - W_light| change over any interval both tenants are backlogged."""
    s = make(policy)
    arrivals = {0: [request(f"h{i}", "heavy", 64, 16, 0) for i in range(300)]
                + [request(f"l{i}", "light", 64, 16, 0) for i in range(30)]}
    served, gaps = {}, []

    def on_step(s, out):
        weighted_service(s, out, served)
        waiting = {r.tenant for r in s.waiting}
        if {"heavy", "light"} <= waiting:
            gaps.append(served.get("heavy", 0.0) - served.get("light", 0.0))
    drive(s, arrivals, on_step)
    assert s.num_preemptions_total == 0  # the bound below has no recompute in it
    return max(gaps) - min(gaps)


def test_service_gap_of_backlogged_tenants_stays_within_the_vtc_bound():
    # Our bound (engine/core/fair_share.py): 2 * U, U = max_num_seqs x the largest request
    # cost (w_p * prompt + w_d * max_tokens): after a tenant's last admission, only what it
    # already runs can raise its counter.
    bound = 2 * 16 * (1.0 * 64 + 2.0 * 16)
    fair = service_gap("fair")
    fcfs = service_gap("fcfs")
    assert fair <= bound, (fair, bound)
    assert fcfs > 2 * bound, (fcfs, bound)  # fcfs serves heavy's 300 first


def test_tenant_weights_split_service_in_proportion():
    s = make("fair", tenant_weights={"gold": 3.0})
    arrivals = {0: [request(f"{t}{i}", t, 64, 16, 0) for t in ("gold", "free")
                    for i in range(120)]}
    served = {}
    shares = []

    def on_step(s, out):
        weighted_service(s, out, served)
        if len({r.tenant for r in s.waiting}) == 2 and served.get("free"):
            shares.append(served["gold"] / served["free"])
    drive(s, arrivals, on_step)
    assert 2.5 < shares[-1] < 3.5, shares[-1]


def test_newly_active_tenant_is_lifted_to_the_active_minimum():
    vtc = VirtualTokenCounter(SchedulerConfig(policy="fair"))
    a, b = request("a", "a", 4, 4, 0), request("b", "b", 4, 4, 1)
    vtc.join(a)
    vtc.charge(a, 4)  # 4 prompt tokens at weight 1
    assert vtc.counter("a") == 4.0
    vtc.join(b)  # idle until now: no credit for it
    assert vtc.counter("b") == 4.0
    queue = FairQueue(vtc)
    queue.add(a)
    queue.add(b)
    assert queue.peek() is a  # tie: the earlier arrival
    a.num_computed_tokens = 4
    vtc.charge(a, 1)  # a decode step: weight 2
    assert vtc.counter("a") == 6.0 and queue.peek() is b
    vtc.leave(a)
    vtc.leave(b)
    assert vtc.counters == {}  # idle: forgotten


def test_preemption_victim_comes_from_the_tenant_with_the_highest_counter():
    # A pool that cannot hold both tenants' requests at full length.
    s = make("fair", seqs=4, budget=64, blocks=8)
    arrivals = {0: [request("h0", "heavy", 16, 48, 0), request("h1", "heavy", 16, 48, 0)],
                1: [request("l0", "light", 16, 48, 1)]}
    victims = []

    def on_step(s, out):
        if out.preempted_req_ids:
            counters = s.fair.counters
            victims.extend((rid, dict(counters)) for rid in out.preempted_req_ids)
    drive(s, arrivals, on_step)
    assert victims
    assert s.anchor is None and all(r.num_preemptions < ANCHOR_PREEMPTIONS for r in
                                    itertools.chain(*arrivals.values()))  # no exception made
    for rid, counters in victims:
        tenant = "heavy" if rid.startswith("h") else "light"
        assert counters[tenant] == max(counters.values()), (rid, counters)


def test_two_tenants_trading_the_pool_both_finish_once_one_is_the_anchor():
    """The livelock hypothesis found: r0 and r1 need 87 blocks of 52; each preemption
    evicted the one whose tenant's counter was ahead, and its recompute put the other one
    ahead, forever. The progress rule (engine/core/scheduler.py): the request preempted a
    second time becomes the anchor; from then on it is never a victim, and while it waits
    nothing else starts (r2, whose tenant's counter is the lowest, arrives just then). All
    finish, with the outputs they get in a pool that holds them all."""
    sched, cache, specs = TWO_TENANTS_TRADING_THE_POOL
    specs = specs + [spec(2, 2, arrive_at_step=62, tenant="c")]

    def run(sched, cache):
        s = Scheduler(sched, cache)
        runner = FakeModelRunner(cache.num_kv_blocks, cache.block_size)
        outputs, anchors, held_back, step = {}, [], [], 0
        while step <= 62 or s.has_unfinished_requests():
            for i, sp in enumerate(specs):
                if sp["arrive_at_step"] == step:
                    s.add_request(Request(f"r{i}", sp["prompt"], sp["params"],
                                          arrival_time=float(i), tenant=sp["tenant"]))
            anchor = s.anchor
            waits = anchor is not None and anchor.status == RequestStatus.PREEMPTED
            by_counter = s.waiting.peek() if waits else None
            out, ids = schedule(s)
            if anchor is not None:
                assert anchor.request_id not in ids.preempted, step
            if waits:
                assert set(ids.new + ids.resumed) <= {anchor.request_id}, step
                held_back += [(r.request_id, r is by_counter) for r in s.waiting]
            if s.anchor is not None and s.anchor is not anchor:
                anchors.append((s.anchor.request_id, s.anchor.num_preemptions))
            for r in s.update_from_output(out, runner.execute(out)):
                if r.is_finished:
                    outputs[r.request_id] = r.output_token_ids
            step += 1
            assert step < 1000, "no progress"
        check_drained(s)
        return outputs, anchors, held_back

    outputs, anchors, held_back = run(sched, cache)
    assert anchors == [("r1", ANCHOR_PREEMPTIONS)]
    assert held_back == [("r2", True)]  # the counters' pick, held back for the anchor
    roomy, no_anchors, _ = run(SchedulerConfig(max_num_batched_tokens=52, max_model_len=52),
                               CacheConfig(block_size=1, num_kv_blocks=200))
    assert outputs == roomy and not no_anchors


@pytest.mark.parametrize("bad, message", [
    (dict(policy="lottery"), "policy must be one of"),
    (dict(admission="greedy"), "admission must be one of"),
    (dict(tenant_weights={"a": 0}), r"tenant_weights\['a'\] must be a finite number > 0"),
    (dict(fair_decode_weight=-1.0), "fair_decode_weight must be"),
])
def test_bad_fair_settings_are_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**bad)


def test_config_strings_become_the_fair_and_admission_settings():
    from engine.config import EngineConfig
    config = EngineConfig.from_dict({"policy": "fair", "admission": "no_evict",
                                     "tenant_weights": '{"gold": 2, "free": "0.5"}',
                                     "fair_decode_weight": "1.5"}).scheduler
    assert (config.policy, config.admission, config.fair_decode_weight) == ("fair", "no_evict", 1.5)
    assert config.tenant_weights == {"gold": 2.0, "free": 0.5}
    with pytest.raises(ValueError, match="engine argument 'tenant_weights': invalid JSON"):
        EngineConfig.from_dict({"tenant_weights": "{gold: 2}"})
    with pytest.raises(ValueError, match=r"tenant_weights'\['gold'\] must be a number"):
        EngineConfig.from_dict({"tenant_weights": '{"gold": "lots"}'})
    with pytest.raises(ValueError, match="admission must be one of"):
        EngineConfig.from_dict({"admission": "eager"})


def test_served_tokens_are_kept_per_tenant_up_to_the_cap_then_as_other():
    from engine.core.fair_share import MAX_TENANT_SERIES, OTHER_TENANTS
    vtc = VirtualTokenCounter(SchedulerConfig(policy="fair"))
    for i in range(MAX_TENANT_SERIES + 5):
        r = request(f"r{i}", f"t{i}", 4, 4, i)
        vtc.join(r)
        vtc.charge(r, 4)
    assert len(vtc.tokens_served) == MAX_TENANT_SERIES + 1
    assert vtc.tokens_served[OTHER_TENANTS] == 5 * 4 and vtc.tokens_served["t0"] == 4
