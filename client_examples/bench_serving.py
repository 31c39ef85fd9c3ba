"""Serving benchmark for the Triton `llm` model over gRPC streaming.

Two kinds of load, each swept over levels:
  --concurrency 1,4,16   closed loop: N clients, each sends its next request when the last ends
  --request-rate 2,8,inf open loop: Poisson arrivals at that many requests/s, whatever the server does
Per level it reports TTFT, inter-token latency and end-to-end latency (p50/p90/p99),
output tokens/s and requests/s; writes JSON (--out) and a latency-vs-load PNG (--plot).

Why threads and the sync client rather than tritonclient.grpc.aio: only the sync client can
ask for an empty final response (enable_empty_final_response), which is how a client learns
that a decoupled request has ended when the model sends FINAL without data.
"""
from __future__ import annotations

import argparse
import json
import math
import queue
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as `python client_examples/bench_serving.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from client_examples.bench_stats import LevelResult, format_table, summarize_level  # noqa: E402
from client_examples.bench_workload import RequestSpec, WorkloadSpec, make_requests, poisson_arrival_times  # noqa: E402
from client_examples.common import GenerationRecord, GrpcStreamSession  # noqa: E402


def parse_levels(text: str) -> list[float]:
    """'1,4,16' -> [1.0, 4.0, 16.0]; 'inf' allowed (rates); empty -> []."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part:
            value = float(part)
            if value <= 0:
                raise argparse.ArgumentTypeError(f"load levels must be > 0, got {part}")
            out.append(value)
    return out


def parse_range(text: str) -> tuple[int, int]:
    """'32' or '16:64' -> inclusive (lo, hi)."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 1 or hi_i < lo_i:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: need 1 <= lo <= hi")
    return lo_i, hi_i


def run_closed_loop(args, requests: list[RequestSpec], concurrency: int):
    sessions = [GrpcStreamSession(args.url, args.model) for _ in range(concurrency)]
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(requests)):
        todo.put(i)
    records: list = [None] * len(requests)
    bar = tqdm(total=len(requests), desc=f"concurrency {concurrency}", unit="req", leave=False)

    def client(session: GrpcStreamSession):
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            records[i] = session.generate(requests[i].prompt, requests[i].sampling(), timeout_s=args.timeout)
            bar.update(1)

    # Streams are connected above, so the clock measures serving, not channel setup.
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    bar.close()
    for s in sessions:
        s.close()
    return records, duration, 0.0


def run_open_loop(args, requests: list[RequestSpec], rate: float):
    """Poisson arrivals; each request gets a free stream from a pool of --max-inflight.

    If the pool runs dry the send is late; the largest lateness is reported so a run
    that was limited by the client rather than the server is visible.
    """
    offsets = poisson_arrival_times(len(requests), rate, args.seed + 1)
    pool_size = min(args.max_inflight, len(requests))
    idle: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(pool_size):
        idle.put(GrpcStreamSession(args.url, args.model))
    records: list = [None] * len(requests)
    lateness = [0.0] * len(requests)
    label = "rate inf" if math.isinf(rate) else f"rate {rate:g}/s"
    bar = tqdm(total=len(requests), desc=label, unit="req", leave=False)

    def one(i: int, due: float):
        session = idle.get()
        lateness[i] = time.perf_counter() - due
        records[i] = session.generate(requests[i].prompt, requests[i].sampling(), timeout_s=args.timeout)
        idle.put(session)
        bar.update(1)

    start = time.perf_counter()
    threads = []
    for i, offset in enumerate(offsets):
        due = start + offset
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i, due), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    bar.close()
    for _ in range(pool_size):
        idle.get().close()
    return records, duration, max(lateness)


def warm_up(args, requests: list[RequestSpec]) -> None:
    if args.warmup <= 0:
        return
    session = GrpcStreamSession(args.url, args.model)
    try:
        for spec in requests[: args.warmup]:
            rec = session.generate(spec.prompt, spec.sampling(), timeout_s=args.timeout)
            if not rec.ok:
                raise SystemExit(f"warm-up request failed: {rec.error}")
    finally:
        session.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="Triton gRPC address (host:port)")
    p.add_argument("--model", default="llm")
    p.add_argument("--concurrency", type=parse_levels, default=[1.0, 4.0, 16.0],
                   help="closed-loop levels, e.g. 1,4,16 ('' to skip)")
    p.add_argument("--request-rate", type=parse_levels, default=[],
                   help="open-loop Poisson rates in req/s, e.g. 2,8,inf")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per load level")
    p.add_argument("--prompt-words", type=parse_range, default=(16, 128), help="uniform range a:b")
    p.add_argument("--output-tokens", type=parse_range, default=(16, 64), help="uniform range c:d")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    p.add_argument("--max-inflight", type=int, default=64, help="open loop: streams in the client's pool")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--out", default="bench_serving.json", help="JSON result path")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = p.parse_args(argv)
    if not args.concurrency and not args.request_rate:
        p.error("nothing to run: give --concurrency and/or --request-rate")

    spec = WorkloadSpec(args.num_prompts, args.prompt_words, args.output_tokens, args.seed)
    requests = make_requests(spec)
    print(f"workload: {args.num_prompts} requests per level; {spec.describe()}", file=sys.stderr)
    warm_up(args, requests)

    plan = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.request_rate]
    levels: list[LevelResult] = []
    extras = []
    for mode, load in plan:
        if mode == "concurrency":
            records, duration, late = run_closed_loop(args, requests, int(load))
        else:
            records, duration, late = run_open_loop(args, requests, load)
        level = summarize_level(mode, load, records, [r.output_tokens for r in requests], duration)
        levels.append(level)
        extras.append({"max_send_lateness_s": late, "requests": [_request_row(r) for r in records]})
        print(f"{level.label}: {level.completed} ok, {level.failed} failed in {duration:.1f}s"
              + (f"; errors: {level.errors}" if level.errors else ""), file=sys.stderr)

    sources = sorted({lv.token_source for lv in levels})
    print()
    print(format_table(levels))
    print(f"\noutput tokens counted from: {', '.join(sources)} "
          f"({'server num_output_tokens' if sources == ['num_output_tokens'] else 'see per-level token_source'})")
    mismatched = sum(lv.length_mismatches for lv in levels)
    if mismatched:
        print(f"warning: {mismatched} requests produced a different token count than max_tokens/min_tokens asked")

    result = {
        "config": {"url": args.url, "model": args.model, "num_prompts": args.num_prompts, "seed": args.seed,
                   "prompt_words": list(args.prompt_words), "output_tokens": list(args.output_tokens),
                   "workload": spec.describe(), "warmup": args.warmup, "max_inflight": args.max_inflight},
        "levels": [{**_jsonable(asdict(lv)), "label": lv.label, **ex} for lv, ex in zip(levels, extras)],
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot_path = args.plot or str(Path(args.out).with_suffix(".png"))
    from client_examples.bench_plot import plot_latency_vs_load

    plot_latency_vs_load(levels, plot_path, title=f"{args.model} @ {args.url}: {spec.describe()}")
    print(f"wrote {args.out} and {plot_path}")
    return 0 if all(lv.failed == 0 for lv in levels) else 1


def _request_row(record: GenerationRecord) -> dict:
    first = next((c.t for c in record.chunks if c.text), None)
    return {"ok": record.ok, "error": record.error, "responses": len(record.chunks),
            "ttft_s": None if first is None else first - record.send_time,
            "e2e_s": None if record.end_time is None else record.end_time - record.send_time}


def _jsonable(obj):
    """JSON has no NaN/inf; write them as null / the string 'inf'."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf"
        return obj
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
