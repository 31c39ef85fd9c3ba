"""What prompt logprobs cost: a loglikelihood-style workload (lm-eval's: whole prompts,
one generated token) with and without SamplingParams.prompt_logprobs, beside the
arithmetic floor, a plain prefill plus the lm_head over every prompt position (timed
here on the same rows). Rounds alternate the sides; best of each printed with ratios.

  python -m bench.bench_prompt_logprobs            # the default model, dtype auto
  python -m bench.bench_prompt_logprobs --model DIR --num-prompts 32 --prompt-len 512"""
from __future__ import annotations

import argparse
import random
import time

import torch

from engine import LLM, SamplingParams


def lm_head_seconds(llm: LLM, rows: int, slice_rows: int = 512) -> float:
    """The lm_head over `rows` hidden states, a slice at a time (what a prefill that kept
    every position's logits would add)."""
    loaded = llm.llm_engine.loaded
    hidden = torch.randn(slice_rows, loaded.hidden_size, dtype=loaded.dtype)
    with torch.inference_mode():
        loaded.model.compute_logits(hidden)
        start = time.perf_counter()
        for begin in range(0, rows, slice_rows):
            loaded.model.compute_logits(hidden[:min(slice_rows, rows - begin)])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--k", type=int, default=1, help="prompt_logprobs (lm-eval asks 1)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False)
    vocab = llm.llm_engine.loaded.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    tokens = args.num_prompts * args.prompt_len
    sides = {"prefill": SamplingParams(temperature=0, max_tokens=1),
             "prompt_logprobs": SamplingParams(temperature=0, max_tokens=1,
                                               prompt_logprobs=args.k)}
    llm.generate(prompts[:2], list(sides.values())[:1] * 2, use_tqdm=False)  # warm-up
    best = {name: float("inf") for name in [*sides, "lm_head"]}
    for r in range(args.rounds):
        for name, params in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best[name] = min(best[name], time.perf_counter() - start)
        best["lm_head"] = min(best["lm_head"], lm_head_seconds(llm, tokens))
    floor = best["prefill"] + best["lm_head"]
    dtype = str(llm.llm_engine.loaded.dtype).removeprefix("torch.")
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, dtype {dtype}, "
          f"prompt_logprobs={args.k}")
    print(f"prefill alone           {tokens / best['prefill']:9.0f} tok/s")
    print(f"prefill + lm_head floor {tokens / floor:9.0f} tok/s")
    print(f"with prompt_logprobs    {tokens / best['prompt_logprobs']:9.0f} tok/s   "
          f"{best['prompt_logprobs'] / floor:.2f}x the floor, "
          f"{best['prompt_logprobs'] / best['prefill']:.2f}x the prefill")


if __name__ == "__main__":
    main()
