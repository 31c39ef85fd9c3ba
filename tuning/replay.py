"""Replay a recorded workload on the real Scheduler and KVCacheManager under any engine
arguments, with a virtual clock advanced by the step-time model: no model runs.

Each recorded request comes back with its arrival time, priority, limits and output
length, and a synthetic prompt whose blocks are equal exactly where the recorded chained
block hashes were (the same prefixes are shared, to the same depth). It finishes after
its recorded number of output tokens, or is cancelled at its recorded time. A trace
recorded with speculative decoding replays its drafts and acceptance (tuning/spec_replay.py;
--set num_speculative_tokens=N replays another k, 0 none).

    python -m tuning.replay TRACE [--set max_num_seqs=32 ...] [--compare]
--compare prints the measured figures of the trace beside the replay's (the replay must
run under the recorded settings for that to mean anything).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.api import (CacheConfig, KVCacheLayout, Request, SamplingParams, Scheduler,
                        SchedulerConfig, build_layout, convert, step_features)
from tuning.spec_replay import Drafter, num_speculative_tokens, recorded_totals
from tuning.tables import comparison_table
from tuning.step_model import StepModel, held_out_error, step_durations
from tuning.trace_file import Trace, read_trace

_FIELDS = {cls: {f.name: f for f in dataclasses.fields(cls)}
           for cls in (SchedulerConfig, CacheConfig)}


def kv_layout_of(trace: Trace) -> KVCacheLayout | None:
    """The recorded model's KV-cache groups (its layers' windows, engine/core/kv_cache/
    groups.py); None for a trace recorded before the header carried them: one full group."""
    windows = trace.header.get("kv_layer_windows")
    return build_layout(windows) if windows else None


def configs(trace: Trace, overrides: dict[str, Any]) -> tuple[SchedulerConfig, CacheConfig]:
    """The recorded engine arguments with `overrides` on top (values may be strings)."""
    args = {**trace.engine_args, **overrides}
    unknown = set(overrides) - set(_FIELDS[SchedulerConfig]) - set(_FIELDS[CacheConfig])
    if unknown:
        raise ValueError(f"not a scheduler or cache argument: {sorted(unknown)}")
    built = []
    for cls, fields in _FIELDS.items():
        values = {name: convert(name, args[name], str(f.type))
                  for name, f in fields.items() if name in args}
        built.append(cls(**values))
    sched, cache = built
    layout = kv_layout_of(trace)
    if "num_kv_blocks" not in overrides and ("kv_cache_memory_bytes" in overrides
                                             or "block_size" in overrides):
        # The pool's bytes stay (or are what was given); blocks follow from them. A block
        # holds group_size layers' K/V (all layers with one group), as the engine sizes it.
        per_token = trace.header["kv_bytes_per_token"]
        if layout is not None:
            per_token = per_token // layout.num_layers * layout.group_size
        pool = cache.kv_cache_memory_bytes or (trace.engine_args["num_kv_blocks"]
                                               * trace.engine_args["block_size"] * per_token)
        cache = dataclasses.replace(cache, num_kv_blocks=int(pool // (per_token * cache.block_size)))
    # As the engine refuses at start-up: a pool that cannot hold one request of
    # max_model_len could leave a request waiting forever. Windowed groups hold only
    # their window's blocks, so the engine's peak rule, not max_model_len's blocks.
    if layout is None:
        needed = -(-sched.max_model_len // cache.block_size)
    else:
        needed = layout.peak_blocks(sched.max_model_len, cache.block_size,
                                    sched.max_num_batched_tokens)
    if cache.num_kv_blocks - cache.watermark_blocks < needed:
        raise ValueError(f"{cache.num_kv_blocks} blocks of {cache.block_size} tokens cannot hold "
                         f"one request of max_model_len={sched.max_model_len}")
    return sched, cache


@dataclass(slots=True)
class RequestResult:
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    first_scheduled: float | None = None
    output_len: int = 0
    num_preemptions: int = 0
    prompt_len: int = 0
    num_cached_tokens: int = 0
    cancelled: bool = False


@dataclass(slots=True)
class Summary:
    ttft: dict[str, float]
    itl: dict[str, float]
    e2e: dict[str, float]
    queue: dict[str, float]
    output_tokens_per_s: float
    preemptions: int
    prefix_hit_rate: float
    requests: int
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    a = np.array(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def summarize(results: list[RequestResult], steps: int = 0) -> Summary:
    done = [r for r in results if r.first_token is not None]
    itl = [(r.finish - r.first_token) / (r.output_len - 1) for r in done
           if r.output_len > 1 and r.finish is not None]
    start = min(r.arrival for r in results)
    end = max(r.finish for r in results if r.finish is not None)
    prompt = sum(r.prompt_len for r in results)
    return Summary(
        ttft=_percentiles([r.first_token - r.arrival for r in done]),
        itl=_percentiles(itl),
        e2e=_percentiles([r.finish - r.arrival for r in done if r.finish is not None]),
        queue=_percentiles([r.first_scheduled - r.arrival for r in results
                            if r.first_scheduled is not None]),
        output_tokens_per_s=sum(r.output_len for r in results) / max(end - start, 1e-9),
        preemptions=sum(r.num_preemptions for r in results),
        prefix_hit_rate=sum(r.num_cached_tokens for r in results) / max(prompt, 1),
        requests=len(results), steps=steps)


def measured(trace: Trace) -> Summary:
    """What the recorded run itself saw."""
    summary = summarize([RequestResult(
        arrival=r["arrival"], first_token=r["first_token"], finish=r["finish"],
        output_len=r["output_len"], num_preemptions=r["num_preemptions"],
        prompt_len=r["prompt_len"], num_cached_tokens=r["num_cached_tokens"],
        cancelled=r["cancel"] is not None) for r in trace.requests], len(trace.steps))
    if num_speculative_tokens(trace):
        summary.extra["speculative"] = recorded_totals(trace)
    return summary


def synthetic_prompts(trace: Trace) -> list[list[int]]:
    """Token ids with the recorded sharing: a block id per distinct chained hash, unique
    ids for each prompt's partial last block."""
    block_size = trace.header["block_size"]
    block_ids: dict[int, int] = {}
    prompts = []
    for index, record in enumerate(trace.requests):
        tokens: list[int] = []
        for block_hash in record["block_hashes"]:
            number = block_ids.setdefault(block_hash, len(block_ids))
            tokens.extend(number * block_size + j for j in range(block_size))
        tail = record["prompt_len"] - len(tokens)
        tokens.extend(-(index * block_size + j) - 1 for j in range(tail))  # never shared
        prompts.append(tokens)
    return prompts


def start_step(out, results: dict[str, RequestResult], clock: float) -> None:
    """A simulated step starts at `clock`: its requests that never ran before start now."""
    for request in out.scheduled_requests:
        result = results[request.request_id]
        if result.first_scheduled is None:
            result.first_scheduled = clock


def finish_step(scheduler: Scheduler, out, results: dict[str, RequestResult], clock: float,
                drafter: Drafter | None = None) -> None:
    """A simulated step ends at `clock`: every sequence it completed samples a token (its
    value is irrelevant, lengths are what the workload fixes), and a verified draft the
    tokens the drafter keeps of it plus one; then the drafter proposes the next drafts."""
    drafts = out.scheduled_spec_decode_tokens
    sampled = {r.request_id: drafter.sampled(r, len(drafts[r.request_id]))
               if drafter is not None and drafts.get(r.request_id) else [0]
               for r in out.scheduled_requests if r.num_computed_tokens >= r.num_tokens}
    updated = scheduler.update_from_output(out, sampled)
    if drafter is not None:
        drafter.propose(updated)
    for request in updated:
        result = results[request.request_id]
        if result.first_token is None:
            result.first_token = clock
        result.output_len = request.num_output_tokens
        if request.is_finished:
            result.finish = clock


def record_request_counts(requests: dict[str, Request], results: dict[str, RequestResult]) -> None:
    """The per-request counters the scheduler kept, once the simulation is over."""
    for rid, request in requests.items():
        results[rid].num_preemptions = request.num_preemptions
        results[rid].num_cached_tokens = max(request.num_cached_tokens, 0)


def replay(trace: Trace, model: StepModel, overrides: dict[str, Any] | None = None,
           max_steps: int = 5_000_000, seed: int = 0) -> Summary:
    overrides = dict(overrides or {})
    k = int(overrides.pop("num_speculative_tokens", num_speculative_tokens(trace)))
    sched_cfg, cache_cfg = configs(trace, overrides)
    drafter = Drafter.of(trace, k, sched_cfg.max_model_len, seed)
    scheduler = Scheduler(sched_cfg, cache_cfg, kv_layout=kv_layout_of(trace),
                          num_spec_tokens=k if drafter is not None else 0)
    records = trace.requests
    prompts = synthetic_prompts(trace)
    results: dict[str, RequestResult] = {}
    requests: dict[str, Request] = {}
    arrivals = sorted(range(len(records)), key=lambda i: records[i]["arrival"])
    cancels = sorted((r["cancel"], r["id"]) for r in records if r["cancel"] is not None)
    clock, next_arrival, next_cancel, steps = 0.0, 0, 0, 0
    while next_arrival < len(arrivals) or scheduler.has_unfinished_requests():
        while next_arrival < len(arrivals) and records[arrivals[next_arrival]]["arrival"] <= clock:
            record = records[arrivals[next_arrival]]
            cancelled = record["cancel"] is not None
            limit = record["max_tokens"] if cancelled else max(1, record["output_len"])
            request = Request(record["id"], prompts[arrivals[next_arrival]], SamplingParams(
                max_tokens=min(limit, sched_cfg.max_model_len - record["prompt_len"]),
                ignore_eos=True), priority=record["priority"], arrival_time=record["arrival"],
                tenant=record.get("tenant"))
            if record["prompt_len"] < sched_cfg.max_model_len:
                scheduler.add_request(request)
                requests[record["id"]] = request
            results[record["id"]] = RequestResult(record["arrival"], prompt_len=record["prompt_len"])
            next_arrival += 1
        while next_cancel < len(cancels) and cancels[next_cancel][0] <= clock:
            for request in scheduler.finish_requests(cancels[next_cancel][1]):
                results[request.request_id].cancelled = True
            next_cancel += 1
        if not scheduler.has_unfinished_requests():
            if next_arrival < len(arrivals):
                clock = max(clock, records[arrivals[next_arrival]]["arrival"])
            continue
        out = scheduler.schedule()
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"replay made no progress in {max_steps} steps")
        start_step(out, results, clock)
        if not out.scheduled_requests:  # nothing fits until something is cancelled
            clock = cancels[next_cancel][0] if next_cancel < len(cancels) else clock + 1e-3
            continue
        clock += model.predict(step_features(out))
        finish_step(scheduler, out, results, clock, drafter)
    record_request_counts(requests, results)
    summary = summarize(list(results.values()), steps)
    summary.extra["sim_seconds"] = clock
    if drafter is not None:
        summary.extra["speculative"] = drafter.totals()
    summary.extra["per_request"] = results
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="an engine argument to replay under (repeatable)")
    parser.add_argument("--model", help="a step model (JSON, tuning.step_model --out); "
                        "default: fitted on the trace")
    parser.add_argument("--compare", action="store_true",
                        help="print the trace's measured figures beside the replay's")
    parser.add_argument("--out", help="write the summary and every request's replayed "
                        "times (arrival, first scheduled, first token, finish), output "
                        "length, preemptions and cached tokens here (JSON)")
    args = parser.parse_args(argv)
    trace = read_trace(args.trace)
    if args.model:
        with open(args.model, encoding="utf-8") as f:
            model = StepModel.from_json(f.read())
    else:
        model, error = held_out_error(step_durations(trace))
        print(f"step model fitted on {len(trace.steps)} steps; held-out error "
              f"{error['mape']:.1%} (mean), total time {error['total_time_error']:+.1%}")
    overrides = dict(item.split("=", 1) for item in args.set)
    predicted = replay(trace, model, overrides)
    if args.out:
        per_request = predicted.extra.pop("per_request")
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"summary": dataclasses.asdict(predicted),
                       "requests": {rid: dataclasses.asdict(r) for rid, r in per_request.items()}},
                      f, indent=1)
    if args.compare:
        print(comparison_table(measured(trace), predicted))
    else:
        print(f"{predicted.requests} requests, {predicted.steps} steps: TTFT p50/p90/p99 "
              f"{predicted.ttft['p50']:.3f}/{predicted.ttft['p90']:.3f}/{predicted.ttft['p99']:.3f} s, "
              f"ITL p50/p99 {predicted.itl['p50'] * 1e3:.1f}/{predicted.itl['p99'] * 1e3:.1f} ms, "
              f"{predicted.output_tokens_per_s:.1f} output tok/s, {predicted.preemptions} "
              f"preemptions, prefix hits {predicted.prefix_hit_rate:.1%}")


if __name__ == "__main__":
    main()
