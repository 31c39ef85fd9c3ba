"""Multi-LoRA throughput: requests spread over several adapters and the base model in one
batch, against the base model alone (an engine without enable_lora) on the same prompts.

    python -m bench.bench_lora [--model DIR] [--num-prompts 64] [--adapters 4] [--rank 16]

Adapters are random PEFT folders built on the model (testing/lora_adapter.py), on every
q/k/v/o/gate/up/down projection. Same-run ratios only: the host drifts between minutes.

Seen 2026-12-02 on a 2-core share of a busy host (SmolLM2, auto dtype, 32 requests x 32
tokens, 4 adapters of rank 16 + base): base 43.5 tok/s, base with enable_lora 45.0,
mixed 43.7 (1.00x of base)."""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from engine import LLM, LoRARequest, SamplingParams


def timed(llm: LLM, prompts, params, loras, repeat: int) -> float:
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    best = float("inf")
    for _ in range(repeat):
        llm.llm_engine.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        best = min(best, time.perf_counter() - start)
    return len(prompts) * params.max_tokens / best


def main() -> None:
    from bench.bench_generate import make_workload
    from engine.models import default_model_dir
    from testing.lora_adapter import make_lora_adapter_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    model = args.model or str(default_model_dir())
    engine_args = dict(dtype=args.dtype, max_num_seqs=64, max_model_len=512,
                       kv_cache_memory_bytes=1 << 30)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [make_lora_adapter_dir(model, Path(tmp) / f"a{i}", seed=i, r=args.rank,
                                         lora_alpha=args.rank) for i in range(args.adapters)]
        requests = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
        base = LLM(model, **engine_args)
        prompts = make_workload("fixed", base.get_tokenizer(), count=args.num_prompts).prompts
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        # Adapter i for request i mod (adapters + 1); the last slot is the base model.
        slots = [*requests, None]
        loras = [slots[i % len(slots)] for i in range(len(prompts))]
        base_rate = timed(base, prompts, params, None, args.repeat)
        del base
        lora_llm = LLM(model, enable_lora=True, max_loras=args.adapters,
                       max_lora_rank=max(16, args.rank), **engine_args)
        lora_base_rate = timed(lora_llm, prompts, params, None, args.repeat)
        mixed_rate = timed(lora_llm, prompts, params, loras, args.repeat)
    print(f"{args.num_prompts} requests x {args.max_tokens} tokens, {args.adapters} adapters "
          f"of rank {args.rank} + base")
    print(f"  base, enable_lora off : {base_rate:8.1f} tok/s")
    print(f"  base, enable_lora on  : {lora_base_rate:8.1f} tok/s ({lora_base_rate / base_rate:.2f}x)")
    print(f"  mixed adapters + base : {mixed_rate:8.1f} tok/s ({mixed_rate / base_rate:.2f}x)")


if __name__ == "__main__":
    main()
