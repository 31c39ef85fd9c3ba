"""Embedding throughput: this engine's pooling runner (LLM(..., runner="pooling").embed)
against vLLM's CPU build and sentence-transformers on the same folder and the same token
ids, sides alternated per round, ratios printed side by side (issue 47's figure).

  python -m bench.bench_embed --vllm-python .venv-vllm/bin/python --st-python ST/bin/python
  python -m bench.bench_embed --model DIR      # an embedder folder of your own

Without --model, a random-weight encoder of bge-small-en-v1.5's shape (BertModel, 12 layers,
hidden 384, CLS pooling, normalised) is written to a temporary folder. Workload: 512
prompts of 32-256 token ids (seeded), batch 64 (the engine's max_num_seqs, vLLM's too,
sentence-transformers' batch size)."""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from engine import LLM, PoolingParams


def bge_small_folder(root: Path) -> Path:
    from testing.encoder_folders import make_encoder_dir, write_sentence_transformers
    path = make_encoder_dir(root / "bge-small-shape", "BertModel", hidden_size=384,
                            num_hidden_layers=12, num_attention_heads=12,
                            intermediate_size=1536, max_position_embeddings=512,
                            initializer_range=0.02)
    write_sentence_transformers(path, "cls", normalize=True)
    return path


def workload(vocab: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(0)
    # Above the few special ids, below the vocabulary's end.
    return [[rng.randrange(8, vocab) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


def run_peer(python: str, peer: str, model: Path, prompts, dtype: str, batch: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "max_tokens": [0] * len(prompts)}, f)
    try:
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}")
        done = subprocess.run([python, str(Path(__file__).with_name("embed_peer.py")), f.name,
                               "--model", str(model), "--peer", peer, "--dtype", dtype,
                               "--batch", str(batch)],
                              env=env, capture_output=True, text=True, timeout=3600)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(f"{peer} failed:\n{done.stderr[-3000:]}")
    # vLLM logs to stdout while it shuts down, after the result line.
    return json.loads(next(line for line in reversed(done.stdout.splitlines())
                           if line.startswith('{"seconds"')))


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--st-python", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or bge_small_folder(Path(tmp))
        llm = LLM(str(model), runner="pooling", dtype=args.dtype, max_num_seqs=args.batch,
                  max_num_batched_tokens=max(2048, args.max_len))
        dtype = str(llm.llm_engine.loaded.dtype).removeprefix("torch.")
        prompts = workload(llm.llm_engine.loaded.vocab_size, args.num_prompts,
                           args.min_len, args.max_len)
        tokens = sum(map(len, prompts))
        params = PoolingParams()
        llm.embed(prompts[:4], params, use_tqdm=False)  # warm-up
        peers = {"vllm": args.vllm_python, "st": args.st_python}
        best = {"engine": float("inf")}
        heads = {}
        for r in range(args.rounds):
            start = time.perf_counter()
            ours = llm.embed(prompts, params, use_tqdm=False)
            best["engine"] = min(best["engine"], time.perf_counter() - start)
            heads["engine"] = [o.outputs.embedding[:8] for o in ours[:4]]
            for name, python in peers.items():
                if python:
                    result = run_peer(python, name, model, prompts, dtype, args.batch)
                    best[name] = min(best.get(name, float("inf")), result["seconds"])
                    heads[name] = result["heads"]
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in best.items()),
                  flush=True)
        print(f"{args.num_prompts} prompts, {tokens} tokens, dtype {dtype}, model {model.name}")
        for name, seconds in best.items():
            ratio = "" if name == "engine" else f"  engine/{name} {seconds / best['engine']:.2f}x"
            agree = "" if name == "engine" else \
                f"  first vectors' heads cosine >= {min(cosine(a, b) for a, b in zip(heads['engine'], heads[name])):.4f}"
            print(f"{name:8s} {args.num_prompts / seconds:8.1f} seq/s {tokens / seconds:9.0f} tok/s"
                  f"{ratio}{agree}")


if __name__ == "__main__":
    main()
