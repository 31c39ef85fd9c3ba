"""bench_generate's `--workload lora`: the fixed workload's requests spread over several
random PEFT adapters (rank --lora-rank on every q/k/v/o/gate/up/down projection, built
with peft by testing/lora_adapter.py) and the base model, round-robin (request i runs
adapter i mod (adapters + 1), the last slot the base). Columns, alternated --rounds times
in one run (the host's speed drifts between minutes):
  (each request --lora-max-tokens new tokens, 128 by default)
  engine base    an engine without enable_lora, all requests on the base model
  engine mixed   one engine with enable_lora, max_loras = the adapter count
  vLLM CPU       the same mixed batch with the same adapter folders (bench/vllm_lora_peer.py),
                 and its base model alone in the same process."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.peer_runs import run_peer
from engine import LLM, LoRARequest, SamplingParams
from engine.models import resolve_model_dir
from kernels.cpu import features as cpu_features


def assignment(count: int, num_adapters: int) -> list[int | None]:
    """Adapter index per request (None: the base model)."""
    slots = [*range(num_adapters), None]
    return [slots[i % len(slots)] for i in range(count)]


def make_adapters(model_dir, folder: Path, count: int, rank: int) -> list[LoRARequest]:
    """`count` random PEFT adapters of `rank` (alpha = rank) for the model, written under
    `folder` as a0, a1, ..."""
    from testing.lora_adapter import make_lora_adapter_dir

    return [LoRARequest(f"a{i}", i + 1, str(make_lora_adapter_dir(
        model_dir, folder / f"a{i}", seed=i, r=rank, lora_alpha=rank))) for i in range(count)]


def engine_lora_args(count: int, rank: int) -> dict:
    """The engine arguments that serve `count` adapters of `rank` in one step."""
    return {"enable_lora": True, "max_loras": count, "max_lora_rank": max(16, rank)}


def per_request(requests: list[LoRARequest], num_requests: int
                ) -> tuple[list[int | None], list[LoRARequest | None]]:
    """(each request's adapter index, and its LoRARequest), None for the base."""
    slots = assignment(num_requests, len(requests))
    return slots, [None if s is None else requests[s] for s in slots]


def timed(llm: LLM, w, loras, repeat: int) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.max_tokens]
    llm.generate(w.prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    best = float("inf")
    for _ in range(repeat):
        llm.llm_engine.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False, lora_request=loras)
        best = min(best, time.perf_counter() - start)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == w.total_output
    return w.total_output / best


def run_lora(args, engine_args: dict, make_workload) -> None:
    model_dir = resolve_model_dir(args.model)
    # Two engines side by side: a 1 GiB pool each holds the batch (64 x ~200 tokens).
    engine_args = {**engine_args, "kv_cache_memory_bytes": 1 << 30}
    k, rank = args.lora_adapters, args.lora_rank
    with tempfile.TemporaryDirectory() as tmp:
        requests = make_adapters(model_dir, Path(tmp), k, rank)
        base = LLM(args.model, **engine_args)
        dtype = str(base.llm_engine.loaded.dtype).removeprefix("torch.")
        w = make_workload("fixed", base.get_tokenizer(), count=args.num_prompts)
        w.max_tokens = [args.lora_max_tokens] * len(w.prompts)
        slots, loras = per_request(requests, len(w.prompts))
        mixed = LLM(args.model, **engine_lora_args(k, rank), **engine_args)
        figs: dict[str, float] = {}

        def record(label: str, value: float | None) -> None:
            if value:
                figs[label] = max(figs.get(label, 0.0), value)
                print(f"[{time.strftime('%H:%M:%S')}] {label}: {value:.2f} tok/s",
                      file=sys.stderr, flush=True)

        vllm_error = None
        for _ in range(args.rounds):
            record("engine base", timed(base, w, None, args.repeat))
            record("engine mixed", timed(mixed, w, loras, args.repeat))
            if args.vllm_python and vllm_error is None:
                extra = ["--max-lora-rank", str(max(16, rank)),
                         "--assign", ",".join("-" if s is None else str(s) for s in slots),
                         *[f"{r.lora_name}={r.lora_path}" for r in requests]]
                try:
                    r = run_peer(args.vllm_python, "vllm_lora_peer.py", w,
                                 ["--model", str(model_dir), "--repeat", str(args.repeat),
                                  "--dtype", dtype, "--max-model-len", "2048", *extra],
                                 _vllm_env())
                except RuntimeError as exc:
                    vllm_error = _reason(str(exc))
                else:
                    record("vLLM CPU mixed", r["mixed_tok_s"])
                    record("vLLM CPU base", r["base_tok_s"])
    print(f"\nmodel {args.model or 'the embedded SmolLM2-135M'}; CPU "
          f"{cpu_features.detect().describe()}, threads={torch.get_num_threads()} dtype={dtype}")
    print(f"output tokens/s, {len(w.prompts)} requests x {w.max_tokens[0]} tokens over {k} "
          f"adapters of rank {rank} + base (round-robin), best of {args.rounds} rounds x "
          f"{args.repeat}")
    for label, value in figs.items():
        print(f"  {label:<16}{value:>9.1f}")
    if "engine base" in figs and "engine mixed" in figs:
        print(f"  engine mixed / engine base: {figs['engine mixed'] / figs['engine base']:.2f}x")
    if "vLLM CPU mixed" in figs:
        print(f"  engine mixed / vLLM CPU mixed: "
              f"{figs['engine mixed'] / figs['vLLM CPU mixed']:.2f}x; vLLM mixed / vLLM base: "
              f"{figs['vLLM CPU mixed'] / figs['vLLM CPU base']:.2f}x")
    if vllm_error:
        print(f"  vLLM CPU refused the LoRA run: {vllm_error}")


def _reason(stderr: str) -> str:
    """The line of a failed peer's stderr that says why (shutdown warnings come last)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["(no output)"])[-1]


def _vllm_env() -> dict:
    import os
    return dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
                VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2")
