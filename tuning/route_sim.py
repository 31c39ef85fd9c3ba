"""R replicas behind a router, simulated: each replica is the real Scheduler and
KVCacheManager on a virtual clock advanced by the step-time model fitted on a recorded
trace (tuning/step_model.py); no model runs. The KV-aware router knows the replicas'
caches only from their KV-event streams, encoded and decoded as on the wire and
delivered when the step that caused them ends (tuning/kv_index.py).

Policies:
- round_robin: request i goes to replica i mod R;
- least_loaded: fewest unfinished requests (ties: lowest index);
- kv_aware: llm-d's precise prefix-cache scoring: 3 x (share of the prompt's blocks the
  replica holds, from its events) + 2 x (1 - its queue, min-max scaled over replicas)
  + 2 x (1 - its KV usage).

    python -m tuning.route_sim TRACE --replicas 2 4 8 [--prefixes 32 --prefix-len 512 ...]
TRACE gives the step-time model (and the engine arguments each replica runs with); the
workload is synthetic (tuning.workload's generator: shared system prompts, bursty
arrivals, long tails), with the arrival rate scaled by R so that each replica sees the
same load whatever R is.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
from dataclasses import dataclass, field

from engine.api import (BlockHasher, CacheConfig, KVCacheLayout, Request, SamplingParams,
                        Scheduler, SchedulerConfig, encode_batch, external_hash, step_features)
from tuning.kv_index import KVEventIndex
from tuning.replay import (RequestResult, Summary, finish_step, kv_layout_of,
                           record_request_counts, start_step, summarize)
from tuning.step_model import StepModel

POLICIES = ("round_robin", "least_loaded", "kv_aware")
PREFIX_WEIGHT, QUEUE_WEIGHT, KV_WEIGHT = 3.0, 2.0, 2.0


@dataclass(slots=True)
class SimRequest:
    arrival: float
    prompt: list[int]
    max_tokens: int


@dataclass
class Replica:
    scheduler: Scheduler
    index: KVEventIndex = field(default_factory=KVEventIndex)
    ready_at: float = 0.0  # when its step in flight ends
    next_seq: int = 0

    @property
    def load(self) -> int:
        return self.scheduler.get_num_unfinished_requests()


class Router:
    def __init__(self, policy: str, replicas: list[Replica], block_size: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.replicas = replicas
        self.block_size = block_size
        # The router hashes prompts itself, as an outside indexer does.
        self.hasher = BlockHasher("sha256_cbor")
        self.count = 0

    def prompt_keys(self, prompt: list[int]) -> list[int | bytes]:
        return [external_hash(h) for h in self.hasher.chain(prompt, self.block_size)]

    def pick(self, prompt: list[int]) -> int:
        self.count += 1
        replicas = self.replicas
        if self.policy == "round_robin":
            return (self.count - 1) % len(replicas)
        loads = [r.load for r in replicas]
        if self.policy == "least_loaded":
            return loads.index(min(loads))
        keys = self.prompt_keys(prompt)
        low, high = min(loads), max(loads)
        best, best_score = 0, float("-inf")
        for i, replica in enumerate(replicas):
            prefix = replica.index.prefix_hits(keys) / len(keys) if keys else 0.0
            queue = 1.0 - (loads[i] - low) / (high - low) if high > low else 1.0
            kv = 1.0 - replica.scheduler.kv_cache_manager.usage
            score = PREFIX_WEIGHT * prefix + QUEUE_WEIGHT * queue + KV_WEIGHT * kv
            if score > best_score:
                best, best_score = i, score
        return best


def simulate(requests: list[SimRequest], num_replicas: int, policy: str, model: StepModel,
             sched_cfg: SchedulerConfig, cache_cfg: CacheConfig,
             kv_layout: KVCacheLayout | None = None) -> Summary:
    """`kv_layout`: the model's KV-cache groups (None: one full-attention group)."""
    cache_cfg = dataclasses.replace(cache_cfg, prefix_caching_hash_algo="sha256_cbor")
    replicas = [Replica(Scheduler(sched_cfg, cache_cfg, enable_kv_events=True,
                                  kv_layout=kv_layout))
                for _ in range(num_replicas)]
    router = Router(policy, replicas, cache_cfg.block_size)
    deliveries: list[tuple[float, int, int, bytes]] = []  # (time, replica, seq, payload)
    results: dict[str, RequestResult] = {}
    tracked: dict[str, Request] = {}
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    next_arrival, steps = 0, 0
    assigned = [0] * num_replicas

    def deliver_until(t: float) -> None:
        while deliveries and deliveries[0][0] <= t:
            _, r, seq, payload = heapq.heappop(deliveries)
            replicas[r].index.apply(seq, payload)

    while True:
        busy = [i for i, r in enumerate(replicas) if r.scheduler.has_unfinished_requests()]
        step_at = min((replicas[i].ready_at for i in busy), default=float("inf"))
        arrival_at = (requests[order[next_arrival]].arrival if next_arrival < len(order)
                      else float("inf"))
        if arrival_at == step_at == float("inf"):
            break
        if arrival_at <= step_at:
            deliver_until(arrival_at)
            index = order[next_arrival]
            spec = requests[index]
            rid = f"req-{index}"
            chosen = router.pick(spec.prompt)
            assigned[chosen] += 1
            target = replicas[chosen]
            max_tokens = min(spec.max_tokens, sched_cfg.max_model_len - len(spec.prompt))
            request = Request(rid, spec.prompt, SamplingParams(max_tokens=max_tokens,
                                                               ignore_eos=True),
                              arrival_time=spec.arrival)
            target.scheduler.add_request(request)
            target.ready_at = max(target.ready_at, spec.arrival)
            tracked[rid] = request
            results[rid] = RequestResult(spec.arrival, prompt_len=len(spec.prompt))
            next_arrival += 1
            continue
        r = min(busy, key=lambda i: replicas[i].ready_at)
        replica, now = replicas[r], step_at
        deliver_until(now)
        out = replica.scheduler.schedule()
        if not out.scheduled_requests:  # waits for blocks another step will free
            replica.ready_at = now + 1e-3
            continue
        steps += 1
        start_step(out, results, now)
        done_at = now + model.predict(step_features(out))
        replica.ready_at = done_at
        finish_step(replica.scheduler, out, results, done_at)
        events = replica.scheduler.kv_cache_manager.take_events()
        if events:
            heapq.heappush(deliveries, (done_at, r, replica.next_seq, encode_batch(done_at, events)))
            replica.next_seq += 1
    record_request_counts(tracked, results)
    summary = summarize(list(results.values()), steps)
    summary.extra["requests_per_replica"] = assigned
    return summary


def _row(policy: str, replicas: int, s: Summary) -> str:
    return (f"| {replicas} | {policy} | {s.prefix_hit_rate:.1%} | {s.ttft['p50']:.3f} | "
            f"{s.ttft['p99']:.3f} | {s.output_tokens_per_s:.0f} | {s.preemptions} |")


def main(argv: list[str] | None = None) -> None:
    from tuning.workload import WorkloadSpec, plan
    from tuning.replay import configs
    from tuning.step_model import fit, step_durations
    from tuning.trace_file import read_trace

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a recorded trace: the step-time model and engine arguments")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--requests-per-replica", type=int, default=150)
    parser.add_argument("--rate-per-replica", type=float, default=2.0)
    parser.add_argument("--prefixes", type=int, default=32, help="distinct system prompts")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--shared-share", type=float, default=0.9)
    parser.add_argument("--kv-blocks", type=int, default=0,
                        help="KV blocks per replica (0: the trace's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    trace = read_trace(args.trace)
    model = fit(step_durations(trace))
    overrides = {"num_kv_blocks": args.kv_blocks} if args.kv_blocks else {}
    sched_cfg, cache_cfg = configs(trace, overrides)
    print(f"step model from {args.trace}: {len(trace.steps)} steps; per replica: "
          f"{cache_cfg.num_kv_blocks} KV blocks x {cache_cfg.block_size}, max_num_seqs "
          f"{sched_cfg.max_num_seqs}; {args.prefixes} system prompts of {args.prefix_len} tokens "
          f"({args.shared_share:.0%} of requests), {args.rate_per_replica}/s per replica")
    print("| replicas | policy | prefix hit rate | TTFT p50 s | TTFT p99 s | out tok/s | preemptions |")
    print("|---|---|---|---|---|---|---|")
    for replicas in args.replicas:
        spec = WorkloadSpec(requests=args.requests_per_replica * replicas,
                            rate=args.rate_per_replica * replicas,
                            system_prompts=args.prefixes, system_len=args.prefix_len,
                            shared_share=args.shared_share,
                            max_prompt=min(sched_cfg.max_model_len - 1, args.prefix_len + 512),
                            max_output=min(256, sched_cfg.max_model_len // 4), seed=args.seed)
        workload = [SimRequest(p.arrival, p.prompt, p.max_tokens)
                    for p in plan(spec, vocab_size=32_000)]
        for policy in args.policies:
            print(_row(policy, replicas, simulate(workload, replicas, policy, model,
                                                  sched_cfg, cache_cfg, kv_layout_of(trace))),
                  flush=True)


if __name__ == "__main__":
    main()
