"""Peer benchmark: vLLM's CPU build with LoRA adapters, on bench_generate's lora workload
(bench/lora_workload.py). Runs in vLLM's own venv (see bench/vllm_peer.py for its set-up).

Usage: VENV/bin/python bench/vllm_lora_peer.py WORKLOAD.json --model HF_FOLDER
           --assign 0,1,-,... NAME=PATH ...
--assign: per request, the index of its adapter among the NAME=PATH list, or - (the base).
Prints one JSON line (the last of stdout): the mixed batch's and the base batch's tok/s."""
import argparse
import json
import os
import time

from peer_workload import read_workload  # bench/, the script's folder

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("adapters", nargs="+", metavar="NAME=PATH")
    ap.add_argument("--model", required=True)
    ap.add_argument("--assign", required=True)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-lora-rank", type=int, default=16)
    args = ap.parse_args()
    prompts, max_tokens = read_workload(args.workload)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = [LoRARequest(name, i + 1, path) for i, (name, path) in
                enumerate(a.split("=", 1) for a in args.adapters)]
    loras = [None if s == "-" else adapters[int(s)] for s in args.assign.split(",")]
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=64, seed=0,
              max_model_len=args.max_model_len, enable_lora=True, max_loras=len(adapters),
              max_lora_rank=args.max_lora_rank)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
              for n in max_tokens]
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate(reqs[:len(adapters) + 1], [warm] * (len(adapters) + 1), use_tqdm=False,
                 lora_request=loras[:len(adapters) + 1])

    def best(lora_request):
        seconds = float("inf")
        for _ in range(args.repeat):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False, lora_request=lora_request)
            seconds = min(seconds, time.perf_counter() - start)
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds

    result = {"mixed_tok_s": round(best(loras), 2), "base_tok_s": round(best(None), 2)}
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the result still prints
        pass
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
