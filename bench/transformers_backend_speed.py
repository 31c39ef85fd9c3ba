"""The general path (model_impl="transformers": transformers' modeling code over our paged
cache) against the native path on the same Llama folder, in one process, side by side:
output tokens/s of one stream and of a small batch, greedy, ignore_eos.

  python -m bench.transformers_backend_speed                  # the embedded SmolLM2-135M
  python -m bench.transformers_backend_speed --model DIR --batch 8 --new-tokens 128

Each engine is built once; the rounds alternate native and general so that a neighbour's
load lands on both alike, and the best round of each is reported. `--with-before` adds a
third engine, the general path as it ran before its native norms, RoPE and stacked sibling linears
(each nn.Linear prepacked, one kernel call each), to A/B that change in the same rounds."""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time

from engine import LLM, SamplingParams
from engine.models import resolve_model_dir
from engine.models import transformers_kernels
from kernels.cpu import features as cpu_features

PROMPT = ("The history of the printing press begins with woodblock printing in China, and "
          "its arrival in Europe changed")


def tokens_per_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


@contextlib.contextmanager
def as_before():
    """Loads inside give the general path as it was before its native norms, RoPE and
    stacked sibling linears: HF's norm and RoPE code, one kernel call per nn.Linear."""
    module = transformers_kernels
    saved = module._native_norm, module._ROPE_FUNCTION, module._shared_input_groups
    module._native_norm = lambda module: None
    module._ROPE_FUNCTION = "<none>"  # no forward reads such a global
    module._shared_input_groups = lambda model, linears: []
    try:
        yield
    finally:
        module._native_norm, module._ROPE_FUNCTION, module._shared_input_groups = saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Llama-family HF folder (default: "
                        "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--with-before", action="store_true",
                        help="also run the general path as it was before (see as_before)")
    args = parser.parse_args(argv)

    engines = {}
    names = ["native", "transformers"] + (["before"] if args.with_before else [])
    for name in names:
        patch = as_before() if name == "before" else contextlib.nullcontext()
        with patch:
            engines[name] = LLM(args.model, dtype=args.dtype,
                                model_impl="native" if name == "native" else "transformers",
                                num_threads=args.num_threads, max_num_seqs=max(args.batch, 1),
                                enable_prefix_caching=False)
    load_before = os.getloadavg()[0]
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
    before = args.with_before
    print(f"{'workload':<22}{'native tok/s':>14}{'general tok/s':>15}{'general/native':>16}"
          + (f"{'before tok/s':>14}{'before/native':>15}" if before else ""))
    for workload, label in (("single", "single stream"), ("batch", f"batch of {args.batch}")):
        native, general = best["native", workload], best["transformers", workload]
        line = f"{label:<22}{native:>14.1f}{general:>15.1f}{general / native:>16.2f}"
        if before:
            old = best["before", workload]
            line += f"{old:>14.1f}{old / native:>15.2f}"
        print(line)
    print(f"({args.new_tokens} new tokens per request, prompt {len(base)} tokens, best of "
          f"{args.rounds} alternated rounds; 1-minute load average {load_before:.1f} at the "
          f"start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
