"""Offline throughput: this engine's LLM.generate vs HF transformers, same machine,
same prompts, one run. Prints output tokens/s and the ratios side by side.

  python -m bench.bench_generate                      # both workloads, dtype auto (the
                                                      # peers run in the dtype it picks)
  python -m bench.bench_generate --workload fixed --skip-hf
  python -m bench.bench_generate --vllm-python /tmp/vllm-venv/bin/python   # + vLLM CPU (bench/vllm_peer.py),
                                                                           # alternated --rounds times

Workloads (greedy, ignore_eos so lengths are exact):
  fixed     64 prompts (32-64 tokens) x 128 new tokens  (the peers' workload, DESIGN.md 8)
  variable  64 prompts of 64-512 tokens, outputs drawn uniformly from 16-256 tokens
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.models import default_model_dir
from kernels import cpu_features

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact be have do say get make "
         "go know take see come think look want give use find tell ask seem feel try leave call "
         "good new first last long great little own other old right big high different small").split()


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def total_output(self) -> int:
        return sum(self.max_tokens)


def make_workload(name: str, tokenizer, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(64):
        if name == "fixed":
            plen, olen = rng.randint(32, 64), 128
        else:
            plen, olen = rng.randint(64, 512), rng.randint(16, 256)
        text = " ".join(rng.choice(WORDS) for _ in range(plen * 2))
        prompts.append(tokenizer.encode(text)[:plen])
        outs.append(olen)
    return Workload(name, prompts, outs)


def run_engine(llm: LLM, w: Workload, repeat: int) -> float:
    """Best of `repeat` runs: the host's speed drifts by +-20% between minutes, and the
    best run is the one least disturbed. Prefix caching is reset so every run prefills."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.max_tokens]
    llm.generate(w.prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    best = float("inf")
    for _ in range(repeat):
        llm.llm_engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == w.total_output
    return w.total_output / best


def run_hf_static(model, w: Workload, batch: int, pad_id: int) -> float:
    """Fixed batches, left-padded; each batch runs to its longest output, and only the
    tokens each request asked for count."""
    t0 = time.perf_counter()
    for start in range(0, len(w.prompts), batch):
        chunk = w.prompts[start:start + batch]
        want = max(w.max_tokens[start:start + batch])
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=want, min_new_tokens=want,
                           do_sample=False, pad_token_id=pad_id)
    return w.total_output / (time.perf_counter() - t0)


def run_hf_single(model, w: Workload, count: int) -> float:
    t0 = time.perf_counter()
    produced = 0
    for prompt, n in list(zip(w.prompts, w.max_tokens))[:count]:
        with torch.inference_mode():
            model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        produced += n
    return produced / (time.perf_counter() - t0)


def single_stream(llm: LLM, prompt: list[int], n: int = 128) -> float:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return n / (time.perf_counter() - t0)


def run_vllm(python: str, w: Workload, model_dir: Path, repeat: int, dtype: str) -> dict:
    """vLLM's CPU build in its own venv, same prompts and lengths (bench/vllm_peer.py)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": w.prompts, "max_tokens": w.max_tokens}, f)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2")
    script = Path(__file__).with_name("vllm_peer.py")
    done = subprocess.run([python, str(script), f.name, "--model", str(model_dir),
                           "--repeat", str(repeat), "--dtype", dtype], env=env,
                          capture_output=True, text=True, timeout=3600)
    os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM peer failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def copy_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best / 1e9  # read + write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["fixed", "variable", "all"], default="all")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hf-single-count", type=int, default=3,
                    help="requests timed for HF one-at-a-time (tok/s extrapolates)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (see bench/vllm_peer.py)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of the engine and of vLLM; best counts")
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternations engine, vLLM, engine, ...: the host's speed drifts over "
                         "minutes, and alternating keeps one side from getting all the slow ones")
    args = ap.parse_args()

    llm = LLM(None, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048)
    tok = llm.get_tokenizer()
    dtype = str(llm.llm_engine.loaded.dtype).removeprefix("torch.")  # what "auto" chose
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(default_model_dir(),
                                                  torch_dtype=getattr(torch, dtype)).eval()
        hf.generation_config.eos_token_id = None

    names = ["fixed", "variable"] if args.workload == "all" else [args.workload]
    rows = []
    peer_single = None
    for name in names:
        w = make_workload(name, tok)
        ours, vllm_best = 0.0, None
        for _ in range(args.rounds if args.vllm_python else 1):
            ours = max(ours, run_engine(llm, w, args.repeat))
            if args.vllm_python:
                vllm = run_vllm(args.vllm_python, w, default_model_dir(), args.repeat, dtype)
                vllm_best = max(vllm_best or 0.0, vllm["batch_tok_s"])
                if name == "fixed":
                    peer_single = max(peer_single or 0.0, vllm["single_tok_s"])
        static = run_hf_static(hf, w, args.hf_batch, tok.pad_token_id or 0) if hf else None
        single = run_hf_single(hf, w, args.hf_single_count) if hf else None
        rows.append((name, ours, static, single, vllm_best))

    nan = float("nan")
    print(f"\nCPU {cpu_features.detect().describe()}, threads={torch.get_num_threads()} "
          f"dtype={dtype} (--dtype {args.dtype})  (output tokens/s)")
    print(f"{'workload':<10}{'engine':>9}{'HF static':>11}{'HF single':>11}{'vLLM CPU':>10}"
          f"{'vs static':>11}{'vs single':>11}{'vs vLLM':>9}")
    for name, ours, static, single, vllm in rows:
        ratio = lambda peer: f"{ours / peer:.2f}x" if peer else "-"  # noqa: E731
        print(f"{name:<10}{ours:>9.1f}{static or nan:>11.1f}{single or nan:>11.1f}{vllm or nan:>10.1f}"
              f"{ratio(static):>11}{ratio(single):>11}{ratio(vllm):>9}")

    prompt = make_workload("fixed", tok).prompts[0]
    stream = single_stream(llm, prompt)
    if peer_single:
        print(f"\nvLLM CPU single stream: {peer_single:.1f} tok/s")
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.llm_engine.runner.model.parameters())
    bw = copy_bandwidth_gbs()
    roofline = bw * 1e9 / weight_bytes
    print(f"\nsingle stream decode: {stream:.1f} tok/s; roofline {roofline:.1f} tok/s "
          f"({weight_bytes / 1e6:.0f} MB weights per step / {bw:.1f} GB/s copy bandwidth) "
          f"= {stream / roofline:.0%} of roofline")


if __name__ == "__main__":
    main()
