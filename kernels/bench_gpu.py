"""One-shot GPU check, for a session with a CUDA device: python -m kernels.bench_gpu

1. correctness: every Triton kernel against the torch implementation on the same
   CUDA tensors, plus the dispatcher (kernels.paged_attention) choosing Triton;
2. engine: greedy token ids of the default model on CUDA equal those on CPU (fp32),
   each run in a child process (the CPU one with CUDA hidden);
3. bandwidth: achieved bytes/s of each kernel as a fraction of the device's peak.
Exit status 1 if a correctness check fails. Runs in well under 3 minutes on an H200.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

from kernels import reference, triton_ops
from kernels.testing import make_paged_batch

PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}
PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "1, 2, 3, 4, 5,", "Explain what a KV cache is in one sentence."]


def line(tag: str, text: str) -> None:
    print(f"[{tag:>8}] {text}", flush=True)


# ---------------------------------------------------------------- correctness
def check_kernels() -> bool:
    ok = True
    small = triton_ops.AttentionTiles(block_n=16, block_m=16, partition_size=64)
    cases = [  # heads, kv_heads, head_dim, block_size, dtype, seq_lens, query_lens
        (9, 3, 64, 16, torch.bfloat16, [1, 17, 512, 2049, 3000], [1] * 5),
        (32, 8, 128, 16, torch.bfloat16, [5, 700, 2500], [1] * 3),
        (8, 8, 64, 8, torch.float32, [1, 33, 1500], [1] * 3),
        (16, 2, 128, 32, torch.float16, [9, 1024, 1025], [1] * 3),
        (9, 3, 64, 16, torch.bfloat16, [300, 1200, 7, 64, 1], [300, 77, 1, 0, 1]),
        (32, 8, 128, 32, torch.bfloat16, [2000, 513], [2000, 13]),
        (8, 1, 64, 8, torch.float32, [129, 40, 3], [100, 1, 3]),
        (16, 2, 128, 16, torch.float16, [1000, 5], [250, 5]),
    ]
    for index, (heads, kv_heads, dim, block, dtype, seq_lens, query_lens) in enumerate(cases):
        batch = make_paged_batch(seq_lens, query_lens, heads, kv_heads, dim, block, dtype=dtype,
                                 device="cuda", seed=index)
        expected = reference.paged_attention(*batch.attention_args()).float()
        for name, tiles in (("default", triton_ops.DEFAULT_TILES), ("small", small)):
            out = triton_ops.paged_attention(*batch.attention_args(), tiles=tiles).float()
            err = (out - expected).abs().max().item()
            good = math.isfinite(err) and err <= TOLERANCE[dtype] * (1 + expected.abs().max().item())
            ok &= good
            kind = "decode" if max(query_lens) == 1 else "prefill"
            line("PASS" if good else "FAIL",
                 f"{kind:7s} {str(dtype)[6:]:8s} H/KVH={heads}/{kv_heads} D={dim} bs={block} "
                 f"seq_lens={seq_lens} tiles={name}: max|err|={err:.2e}")
    via_dispatch = __import__("kernels").paged_attention(*batch.attention_args())
    direct = triton_ops.paged_attention(*batch.attention_args())
    good = torch.equal(via_dispatch, direct)
    ok &= good
    line("PASS" if good else "FAIL", "kernels.paged_attention on CUDA runs the Triton path")

    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.randn(64, 16, 8, 128, device="cuda").to(dtype)
        fused = torch.randn(300, 24, 128, device="cuda").to(dtype)
        key, value = fused[:, :8], fused[:, 8:16]
        slots = torch.randperm(64 * 16, device="cuda")[:300]
        slots[::7] = -1
        want_k, want_v = cache.clone(), cache.clone()
        reference.reshape_and_cache(key, value, want_k, want_v, slots)
        got_k, got_v = cache.clone(), cache.clone()
        __import__("kernels").reshape_and_cache(key, value, got_k, got_v, slots)
        good = torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        ok &= good
        line("PASS" if good else "FAIL", f"reshape_and_cache {str(dtype)[6:]} 300 tokens, slot -1 skipped")
    return ok


# ---------------------------------------------------------------- engine
def engine_child(device: str, out_path: str) -> None:
    """Runs in a child process: greedy token ids of the default model -> JSON."""
    from engine import LLM, SamplingParams
    try:
        llm = LLM(model=None, dtype="float32", device=device)
        how = f"LLM(device={device!r})"
    except (TypeError, ValueError) as error:  # the engine may not take a device argument
        if "device" not in str(error):
            raise
        how = "LLM() without a device argument"
        if device == "cuda":
            # The runner follows the parameters' device; best effort to put them on CUDA.
            torch.set_default_device("cuda")
            how += " under torch.set_default_device('cuda')"
        llm = LLM(model=None, dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
    used_gpu = torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0
    with open(out_path, "w") as f:
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                   "text": [o.outputs[0].text for o in outputs], "used_gpu": used_gpu,
                   "how": how}, f)


def check_engine(workdir: str) -> bool | None:
    results = {}
    for device in ("cpu", "cuda"):
        path = os.path.join(workdir, f"engine_{device}.json")
        env = dict(os.environ)
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "kernels.bench_gpu", "--engine-child", device,
                               "--engine-out", path], env=env, capture_output=True, text=True,
                              timeout=150)
        if proc.returncode != 0:
            line("FAIL", f"engine on {device} failed (exit {proc.returncode}); stderr tail:")
            print(proc.stderr[-2500:], flush=True)
            return None
        with open(path) as f:
            results[device] = json.load(f)
        line("INFO", f"engine on {device}: {results[device]['how']}, used_gpu="
             f"{results[device]['used_gpu']}, {time.perf_counter() - start:.1f}s")
    if not results["cuda"]["used_gpu"]:
        line("FAIL", "the engine did not allocate GPU memory: it ignored the device request")
        return False
    same = results["cpu"]["tokens"] == results["cuda"]["tokens"]
    for i, (a, b) in enumerate(zip(results["cpu"]["tokens"], results["cuda"]["tokens"])):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        line("PASS" if a == b else "FAIL", f"greedy fp32 prompt {i}: "
             + ("identical" if a == b else f"first differs at token {first}")
             + f"  cuda text: {results['cuda']['text'][i][:60]!r}")
    return same


# ---------------------------------------------------------------- bandwidth
def time_us(fn, min_seconds: float = 0.2) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iterations = 10
    while True:
        start.record()
        for _ in range(iterations):
            fn()
        end.record()
        torch.cuda.synchronize()
        elapsed_ms = start.elapsed_time(end)
        if elapsed_ms / 1e3 >= min_seconds or iterations >= 10_000:
            return elapsed_ms * 1e3 / iterations
        iterations *= 4


def random_paged(num_seqs: int, seq_len: int, query_len: int, heads: int, kv_heads: int,
                 dim: int, block: int, dtype: torch.dtype):
    """Large batches built straight on the GPU (make_paged_batch builds on the host)."""
    blocks_per_seq = -(-seq_len // block)
    caches = [torch.randn(num_seqs * blocks_per_seq + 1, block, kv_heads, dim, device="cuda",
                          dtype=dtype) for _ in range(2)]
    tables = torch.randperm(num_seqs * blocks_per_seq, device="cuda").view(num_seqs, -1).int()
    qsl = torch.arange(0, (num_seqs + 1) * query_len, query_len, device="cuda", dtype=torch.int32)
    lens = torch.full((num_seqs,), seq_len, device="cuda", dtype=torch.int32)
    query = torch.randn(num_seqs * query_len, heads, dim, device="cuda", dtype=dtype)
    return (query, *caches, tables, qsl, lens, dim ** -0.5, query_len, seq_len)


def bench(peak_tbps: float) -> None:
    peak = peak_tbps * 1e12
    for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):
        for ctx in (2048, 8192):
            args = random_paged(64, ctx, 1, heads, kv_heads, dim, 16, torch.bfloat16)
            kv_bytes = 2 * 64 * ctx * kv_heads * dim * 2 + 2 * 64 * heads * dim * 2
            for name, tiles in (("split-K", triton_ops.DEFAULT_TILES),
                                ("no split", triton_ops.AttentionTiles(partition_size=ctx))):
                us = time_us(lambda: triton_ops.paged_attention(*args, tiles=tiles))
                line("BW", f"decode  bf16 B=64 ctx={ctx:5d} H/KVH={heads}/{kv_heads} D={dim:3d} "
                     f"{name:8s}: {us:8.1f} us  {kv_bytes / us / 1e6:6.2f} TB/s = "
                     f"{kv_bytes / us * 1e6 / peak:5.1%} of peak")
            us = time_us(lambda: reference.paged_attention(*args))
            line("BW", f"decode  bf16 B=64 ctx={ctx:5d} H/KVH={heads}/{kv_heads} D={dim:3d} "
                 f"torch   : {us:8.1f} us  {kv_bytes / us / 1e6:6.2f} TB/s (torch path, for scale)")
            del args
    for heads, kv_heads, dim, num_seqs, seq_len, query_len in ((9, 3, 64, 8, 2048, 2048),
                                                              (32, 8, 128, 4, 4096, 512)):
        args = random_paged(num_seqs, seq_len, query_len, heads, kv_heads, dim, 16, torch.bfloat16)
        us = time_us(lambda: triton_ops.paged_attention(*args))
        context = seq_len - query_len
        pairs = num_seqs * query_len * (context + (query_len + 1) / 2)  # attended (q, k) pairs
        flops = 4 * pairs * heads * dim
        moved = 2 * num_seqs * seq_len * kv_heads * dim * 2 + 2 * num_seqs * query_len * heads * dim * 2
        line("BW", f"prefill bf16 {num_seqs}x q={query_len} ctx={seq_len} H/KVH={heads}/{kv_heads} "
             f"D={dim}: {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  "
             f"{moved / us * 1e6 / peak:5.1%} of peak bandwidth")
        del args
    cache = torch.zeros(4096, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.zeros_like(cache)
    key = torch.randn(8192, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(4096 * 16, device="cuda")[:8192]
    us = time_us(lambda: triton_ops.reshape_and_cache(key, key, cache, value_cache, slots))
    moved = 2 * 2 * key.numel() * 2
    line("BW", f"reshape_and_cache bf16 8192 tokens KVH=8 D=128: {us:8.1f} us  "
         f"{moved / us * 1e6 / peak:5.1%} of peak")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--peak-tbps", type=float, default=None,
                        help="device peak memory bandwidth (default: from the device name)")
    parser.add_argument("--workdir", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--engine-child", choices=["cpu", "cuda"], help=argparse.SUPPRESS)
    parser.add_argument("--engine-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        engine_child(args.engine_child, args.engine_out)
        return 0
    if not torch.cuda.is_available():
        line("SKIP", "no CUDA device: nothing to check (the CPU path is covered by the tests)")
        return 0
    import triton
    name = torch.cuda.get_device_name()
    peak = args.peak_tbps or next((v for k, v in PEAK_TBPS.items() if k in name), 4.8)
    line("INFO", f"{name}, torch {torch.__version__}, triton {triton.__version__}, "
         f"peak {peak} TB/s assumed")
    started = time.perf_counter()
    ok = False
    try:
        ok = check_kernels()
    except Exception:
        traceback.print_exc()
        line("FAIL", "kernel correctness checks crashed")
    line("INFO", f"kernel checks done in {time.perf_counter() - started:.1f}s")
    if not args.skip_engine:
        try:
            engine_ok = check_engine(args.workdir)
            line("INFO", f"engine check: {engine_ok}")
        except Exception:
            traceback.print_exc()
            line("FAIL", "engine check crashed (the engine may not be finished yet)")
    try:
        bench(peak)
    except Exception:
        traceback.print_exc()
        line("FAIL", "bandwidth benchmark crashed")
    line("INFO", f"total {time.perf_counter() - started:.1f}s; kernels "
         + ("all PASS" if ok else "had FAILURES"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
