"""Throughput next to a busy neighbour: the same batch quiet, then with CPU-bound processes
beside it, for the engine's adaptive threads (num_threads=0) and for a fixed count of all
CPUs (the old default). Prints output tokens/s and each run's share of its quiet figure.

  python -m bench.bench_neighbour [--neighbours 1] [--requests 16] [--tokens 64]

Losing one of two cores should cost about half the throughput, not 5x.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

from engine import LLM, SamplingParams
from kernels.cpu import features as cpu_features


def run(llm: LLM, prompts: list[str], tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) * tokens / (time.perf_counter() - start)


def with_neighbours(count: int, fn):
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(1.0)
        return fn()
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--neighbours", type=int, default=1, help="CPU-bound processes started beside")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="quiet/busy alternations; best counts")
    args = ap.parse_args()
    features = cpu_features.detect()
    print(f"CPU {features.describe()}; {args.requests} requests x {args.tokens} tokens, greedy; "
          f"{args.neighbours} busy neighbour process(es)")
    rows = []
    for label, threads in (("adaptive (num_threads=0)", 0), (f"fixed {features.num_cpus} threads",
                                                             features.num_cpus)):
        llm = LLM(None, num_threads=threads, max_num_seqs=64, max_model_len=1024)
        prompts = [f"Write a short story about a robot named R{i} who" for i in range(args.requests)]
        run(llm, prompts[:2], 4)
        quiet = busy = 0.0
        for _ in range(args.rounds):
            quiet = max(quiet, run(llm, prompts, args.tokens))
            busy = max(busy, with_neighbours(args.neighbours, lambda: run(llm, prompts, args.tokens)))
        rows.append((label, quiet, busy))
        del llm
    print(f"\n{'threads':<28}{'quiet tok/s':>12}{'busy tok/s':>12}{'busy/quiet':>12}")
    for label, quiet, busy in rows:
        print(f"{label:<28}{quiet:>12.1f}{busy:>12.1f}{busy / quiet:>12.2f}")


if __name__ == "__main__":
    main()
