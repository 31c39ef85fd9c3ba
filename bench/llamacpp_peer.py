"""Peer benchmark: llama.cpp (through llama-cpp-python) on a token-id workload. Runs in
its own venv (it never imports this project); bench_generate.py --llamacpp-python calls it.

Set-up (once; pip builds llama.cpp from source, for this host's ISA, so it needs a C++ compiler):
  python3 -m venv /tmp/llama-venv
  /tmp/llama-venv/bin/pip install llama-cpp-python==0.3.16 gguf numpy

Usage: VENV/bin/python bench/llamacpp_peer.py WORKLOAD.json --gguf FILE [--convert F32]
WORKLOAD.json = {"prompts": [[token ids], ...], "max_tokens": [n, ...]}
--convert F32|BF16|F16 runs a dequantized copy of FILE (bench/gguf_convert.py, cached), so
llama.cpp computes at the engine's precision; without it FILE runs as quantized.
Prompts are token ids: the engine's tokenizer and llama.cpp's come from the same GGUF.
Prints exactly one JSON line (the last line of stdout) with the results.

The high-level API serves one sequence at a time, so "batch" here is the workload's
requests run one after another (greedy, exactly max_tokens each, EOS ignored):
total output tokens / total time. --batch-count N times only the first N requests.
"""
import argparse
import json
import os
import sys
import time

from peer_workload import read_workload  # bench/, the script's folder


def greedy(llm, prompt, n, clock=None):
    """Generate exactly n tokens greedily from a fresh context (every call prefills);
    `clock`, when given, collects the time after each token."""
    llm.reset()
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(tok)
        if clock is not None:
            clock.append(time.perf_counter())
        if len(out) == n:
            break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--convert", choices=["F32", "BF16", "F16"], help="dequantize FILE to this first")
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch-count", type=int, default=0, help="requests timed serially (0: all)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="load without llama.cpp's extra CPU buffer types (its AMX and repacked "
                         "layouts): 0.3.36 segfaults with them on SmolLM2's Q4_1 file on AMX hosts")
    args = ap.parse_args()

    prompts, max_tokens = read_workload(args.workload)

    path, convert_s = args.gguf, 0.0
    if args.convert:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gguf_convert import cached_conversion
        t = time.perf_counter()
        path = str(cached_conversion(args.gguf, args.convert))
        convert_s = time.perf_counter() - t

    import llama_cpp
    if args.no_extra_bufts:
        # Llama() takes no such argument; it builds its parameters from this function.
        defaults = llama_cpp.llama_cpp.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params
        llama_cpp.llama_cpp.llama_model_default_params = without_extra_bufts
        llama_cpp.llama_model_default_params = without_extra_bufts
    n_ctx = max(len(p) + n for p, n in zip(prompts, max_tokens))
    n_ctx = max(n_ctx, len(prompts[0]) + args.single_tokens + 1) + 16
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, seed=0, verbose=False)
    startup_s = time.perf_counter() - t0
    from gguf import LlamaFileType
    file_type = LlamaFileType(int(llm.metadata.get("general.file_type", 0))).name

    greedy(llm, prompts[0][:8], 8)  # warm-up

    # Single stream: first prompt, single_tokens + 1 tokens. single_tok_s counts the first
    # single_tokens tokens over the request's wall time, prefill included, as the engine's
    # and vLLM's figures are taken; decode_tok_s is the pure decode rate (first token to
    # the (single_tokens + 1)-th); best of --repeat.
    single_s = decode_s = ttft_s = float("inf")
    for _ in range(args.repeat):
        clock = []
        t = time.perf_counter()
        single_ids = greedy(llm, prompts[0], args.single_tokens + 1, clock)
        ttft_s = min(ttft_s, clock[0] - t)
        single_s = min(single_s, clock[-2] - t)
        decode_s = min(decode_s, clock[-1] - clock[0])

    # "Batch": the requests one after another; best of --repeat.
    count = args.batch_count or len(prompts)
    batch_s, batch_tokens, first_ids = float("inf"), 0, []
    for _ in range(args.repeat):
        t = time.perf_counter()
        outs = [greedy(llm, p, n) for p, n in zip(prompts[:count], max_tokens[:count])]
        batch_s = min(batch_s, time.perf_counter() - t)
        batch_tokens = sum(len(o) for o in outs)
        first_ids = outs[0][:32]
    assert batch_tokens == sum(max_tokens[:count]), "a request stopped short"

    result = {
        "llama_cpp_version": llama_cpp.__version__,
        "gguf": os.path.basename(path),
        "weights": file_type.removeprefix("MOSTLY_").removeprefix("ALL_"),  # e.g. Q4_1, F32
        "threads": args.threads,
        "extra_bufts": not args.no_extra_bufts,
        "convert_s": round(convert_s, 2),
        "startup_s": round(startup_s, 2),
        "num_prompts": len(prompts),
        "batch_requests_timed": count,
        "batch_output_tokens": batch_tokens,
        "batch_seconds": round(batch_s, 3),
        "batch_tok_s": round(batch_tokens / batch_s, 2),
        "single_output_tokens": args.single_tokens,
        "single_seconds": round(single_s, 3),
        "single_tok_s": round(args.single_tokens / single_s, 2),
        "decode_tok_s": round(args.single_tokens / decode_s, 2),
        "ttft_s": round(ttft_s, 4),
        "single_matches_batch_prefix": single_ids[:len(first_ids)] == first_ids[:len(single_ids)],
        "greedy_token_ids_first_prompt": first_ids,
    }
    sys.stdout.flush()
    sys.stderr.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
