"""The routing simulation: replicas are real schedulers, the KV-aware router sees them
only through their event streams, and on a workload with more shared prefixes than one
replica can cache, routing by prefix keeps far more of them hit than round robin."""
import dataclasses
import random

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache.publisher import encode_batch
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from tuning.route_sim import Replica, Router, SimRequest, simulate
from tuning.step_model import StepModel

MODEL = StepModel(0.004, {"prefill_tokens": 2e-5, "decode_tokens": 4e-4, "context_tokens": 1e-7,
                          "num_prefills": 1e-3}, 0.004)


def workload(num_prefixes=12, prefix_len=96, requests=240, rate=40.0, seed=0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 30_000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    clock, out = 0.0, []
    for _ in range(requests):
        clock += rng.expovariate(rate)
        prompt = prefixes[rng.randrange(num_prefixes)] + [rng.randrange(10, 30_000)
                                                          for _ in range(rng.randrange(4, 24))]
        out.append(SimRequest(clock, prompt, rng.randrange(4, 24)))
    return out


def configs(num_blocks):
    return (SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=256),
            CacheConfig(num_kv_blocks=num_blocks, block_size=16))


def test_kv_aware_routing_beats_round_robin_when_prefixes_outgrow_one_cache():
    requests = workload()
    # 12 prefixes x 6 blocks = 72 blocks of prefixes; each replica holds 48 blocks.
    sched, cache = configs(48)
    results = {policy: simulate(requests, 4, policy, MODEL, sched, cache)
               for policy in ("round_robin", "least_loaded", "kv_aware")}
    for summary in results.values():
        assert summary.requests == len(requests)
        assert sum(summary.extra["requests_per_replica"]) == len(requests)
    rr, kv = results["round_robin"], results["kv_aware"]
    assert kv.prefix_hit_rate > rr.prefix_hit_rate + 0.15, (kv.prefix_hit_rate, rr.prefix_hit_rate)
    assert kv.ttft["p50"] < rr.ttft["p50"]
    # Every replica got work: the load terms keep one popular prefix from piling up.
    assert min(kv.extra["requests_per_replica"]) > 0


def test_router_hashes_prompts_as_the_replicas_publish_them():
    sched, cache = configs(64)
    requests = workload(num_prefixes=2, requests=20, rate=5.0)
    replica = Replica(Scheduler(sched, dataclasses.replace(cache, prefix_caching_hash_algo="sha256_cbor"),
                                enable_kv_events=True))
    router = Router("kv_aware", [replica], 16)
    prompt = requests[0].prompt
    replica.scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    while replica.scheduler.has_unfinished_requests():
        out = replica.scheduler.schedule()
        replica.scheduler.update_from_output(out, {r.request_id: [0] for r in out.scheduled_requests})
    replica.index.apply(0, encode_batch(0.0, replica.scheduler.kv_cache_manager.take_events()))
    assert replica.index.prefix_hits(router.prompt_keys(prompt)) == len(prompt) // 16
