"""Scheduler overhead per step (schedule + update_from_output), no model.

N running decode requests, with and without 10,000 requests waiting behind them
(max_num_seqs = N, so the waiting queue is examined but never admitted)."""
from __future__ import annotations

import argparse
import time

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler


def measure(num_running: int, num_waiting: int, steps: int, block_size: int = 16) -> float:
    sched = SchedulerConfig(max_num_batched_tokens=max(8192, num_running), max_num_seqs=num_running,
                            max_model_len=4096)
    cache = CacheConfig(num_kv_blocks=num_running * 40 + 64, block_size=block_size)
    s = Scheduler(sched, cache)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(num_running):
        s.add_request(Request(f"run{i}", [i % 1000 + 1] * 32 + [i], params))
    while s.waiting:  # admit and prefill everyone
        out = s.schedule()
        s.update_from_output(out, {r.request_id: [5] for r in out.scheduled_requests})
    for i in range(num_waiting):
        s.add_request(Request(f"wait{i}", [7, 8, 9, i], params))
    sampled = {f"run{i}": [11] for i in range(num_running)}
    for _ in range(20):  # warm up
        s.update_from_output(s.schedule(), sampled)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = s.schedule()
        s.update_from_output(out, sampled)
    per_step = (time.perf_counter() - t0) / steps
    assert len(out.scheduled_requests) == num_running
    return per_step * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    print(f"{'running':>8} {'waiting=0 us/step':>18} {'waiting=10k us/step':>20} {'us/request':>11}")
    for n in (16, 64, 256, 1024):
        empty = measure(n, 0, args.steps)
        full = measure(n, 10_000, args.steps)
        print(f"{n:>8} {empty:>18.1f} {full:>20.1f} {full / n:>11.2f}")


if __name__ == "__main__":
    main()
