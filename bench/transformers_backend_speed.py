"""The general path (model_impl="transformers": transformers' modeling code over our paged
cache) against the native path on the same Llama folder, in one process, side by side:
output tokens/s of one stream and of a small batch, greedy, ignore_eos.

  python -m bench.transformers_backend_speed                  # the embedded SmolLM2-135M
  python -m bench.transformers_backend_speed --model DIR --batch 8 --new-tokens 128

Each engine is built once; the rounds alternate native and general so that a neighbour's
load lands on both alike, and the best round of each is reported."""
from __future__ import annotations

import argparse
import gc
import time

from engine import LLM, SamplingParams
from engine.models import resolve_model_dir
from kernels.cpu import features as cpu_features

PROMPT = ("The history of the printing press begins with woodblock printing in China, and "
          "its arrival in Europe changed")


def tokens_per_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Llama-family HF folder (default: "
                        "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=0)
    args = parser.parse_args(argv)

    engines = {}
    for impl in ("native", "transformers"):
        engines[impl] = LLM(args.model, dtype=args.dtype, model_impl=impl,
                            num_threads=args.num_threads, max_num_seqs=max(args.batch, 1),
                            enable_prefix_caching=False)
    loaded = engines["native"].llm_engine.loaded
    tok = engines["native"].get_tokenizer()
    base = tok.encode(PROMPT)
    # Distinct prompts: no request's prefill is another's cache hit.
    batch = [base + tok.encode(f" {i}") for i in range(args.batch)]
    single = [base]
    best: dict[tuple[str, str], float] = {}
    for impl, llm in engines.items():  # warm: first-call set-up outside the timings
        tokens_per_s(llm, single, 4)
    for _ in range(args.rounds):
        for impl, llm in engines.items():
            for workload, prompts in (("single", single), ("batch", batch)):
                rate = tokens_per_s(llm, prompts, args.new_tokens)
                best[impl, workload] = max(best.get((impl, workload), 0.0), rate)
            gc.collect()
    print(f"model {resolve_model_dir(args.model)} ({loaded.num_layers} layers, "
          f"{str(loaded.dtype).removeprefix('torch.')}); host {cpu_features.detect().describe()}")
    print(f"{'workload':<22}{'native tok/s':>14}{'general tok/s':>15}{'general/native':>16}")
    for workload, label in (("single", "single stream"), ("batch", f"batch of {args.batch}")):
        native, general = best["native", workload], best["transformers", workload]
        print(f"{label:<22}{native:>14.1f}{general:>15.1f}{general / native:>16.2f}")
    print(f"({args.new_tokens} new tokens per request, prompt {len(base)} tokens, best of "
          f"{args.rounds} alternated rounds)")


if __name__ == "__main__":
    main()
