"""A realistic online workload, run in-process against the engine with tracing on: the
trace the replay and the tuner start from (tuning.replay, tuning.tune).

Requests share a few system prompts (prefix-cache hits), arrive in bursts (a Poisson
process whose rate switches between calm and burst), and have long-tailed prompt and
output lengths (log-normal, clipped). Arrivals are honoured in real time: the driver adds
each request when its time comes and steps the engine in between.

  python -m tuning.workload --out /tmp/trace.jsonl [--requests 200 --rate 2 ...]
  python -m tuning.replay /tmp/trace.jsonl --compare
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int = 200
    rate: float = 2.0            # mean arrivals per second while calm
    burst_factor: float = 4.0    # rate multiplier during bursts
    burst_share: float = 0.2     # share of time in bursts
    system_prompts: int = 3
    system_len: int = 96
    shared_share: float = 0.7    # requests that start with a system prompt
    prompt_median: int = 48      # of the user part
    output_median: int = 48
    max_prompt: int = 768
    max_output: int = 256
    seed: int = 0


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    arrival: float
    prompt: list[int]
    max_tokens: int


def plan(spec: WorkloadSpec, vocab_size: int) -> list[PlannedRequest]:
    rng = np.random.default_rng(spec.seed)
    systems = [rng.integers(10, vocab_size, spec.system_len).tolist()
               for _ in range(spec.system_prompts)]
    planned, clock, bursting = [], 0.0, False
    for _ in range(spec.requests):
        # Switch state with the chance that keeps burst_share of the time in bursts.
        if rng.random() < (spec.burst_share if not bursting else 1 - spec.burst_share) * 0.2:
            bursting = not bursting
        rate = spec.rate * (spec.burst_factor if bursting else 1.0)
        clock += rng.exponential(1.0 / rate)
        user_len = int(np.clip(rng.lognormal(np.log(spec.prompt_median), 0.8), 4,
                               spec.max_prompt - spec.system_len))
        prompt = rng.integers(10, vocab_size, user_len).tolist()
        if rng.random() < spec.shared_share:
            prompt = systems[int(rng.integers(len(systems)))] + prompt
        out_len = int(np.clip(rng.lognormal(np.log(spec.output_median), 0.9), 1, spec.max_output))
        planned.append(PlannedRequest(clock, prompt, out_len))
    return planned


def drive(engine, planned: list[PlannedRequest]) -> float:
    """Add each request at its time, step while anything is unfinished; returns seconds."""
    from engine.api import SamplingParams
    start = time.monotonic()
    index = 0
    while index < len(planned) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while index < len(planned) and planned[index].arrival <= now:
            request = planned[index]
            # Its arrival is when it was due, not when the step in flight let it in: the
            # trace's TTFT then includes that wait, as a client's does.
            engine.add_request(f"req-{index}", request.prompt, SamplingParams(
                temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True),
                arrival_time=start + request.arrival)
            index += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif index < len(planned):
            time.sleep(max(0.0, planned[index].arrival - (time.monotonic() - start)))
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="trace path (JSON Lines)")
    for name, f in WorkloadSpec.__dataclass_fields__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="an engine argument (repeatable), e.g. max_num_seqs=16")
    args = parser.parse_args(argv)
    from engine.api import EngineConfig, LLMEngine
    spec = WorkloadSpec(**{name: getattr(args, name) for name in WorkloadSpec.__dataclass_fields__})
    engine_args = dict(item.split("=", 1) for item in args.set)
    engine = LLMEngine(EngineConfig.from_dict({"trace_path": args.out, **engine_args}))
    planned = plan(spec, engine.loaded.vocab_size)
    seconds = drive(engine, planned)
    engine.trace.close()
    tokens = sum(p.max_tokens for p in planned)
    print(f"{len(planned)} requests over {planned[-1].arrival:.1f} s of arrivals, done in "
          f"{seconds:.1f} s ({tokens / seconds:.1f} output tok/s); trace: {args.out}")


if __name__ == "__main__":
    main()
