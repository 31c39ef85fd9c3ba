"""Peer side of bench/bench_embed.py, run in the peer's own venv (it never imports this
project): vLLM's pooling runner (`--peer vllm`) or sentence-transformers (`--peer st`)
embeds a token-id workload, best of --repeat, after a warm-up.

  VENV/bin/python bench/embed_peer.py WORKLOAD.json --model DIR --peer vllm|st --dtype D
WORKLOAD.json = {"prompts": [[token ids], ...], "max_tokens": [...]} (peer_workload.py;
max_tokens unused). Prints one JSON line, {"seconds": ..., "heads": ...}: the time and
the first vectors' first values (vLLM may log after it).

sentence-transformers gets the ids as its own encode() would have them after tokenizing:
sorted by length, padded per batch of --batch, through its modules (Transformer, Pooling,
Normalize), so what is timed is its model path, not a tokenizer both sides would share."""
import argparse
import json
import os
import time

from peer_workload import read_workload  # bench/, the script's folder

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def vllm_embedder(model: str, dtype: str, batch: int):
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    llm = LLM(model=model, runner="pooling", dtype=dtype, max_num_seqs=batch, seed=0,
              enforce_eager=True)

    def embed(prompts):
        outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
        return [o.outputs.embedding for o in outs]
    return embed


def st_embedder(model: str, dtype: str, batch: int):
    import torch
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(model, device="cpu",
                             model_kwargs={"torch_dtype": getattr(torch, dtype)})
    st.eval()

    def embed(prompts):
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        vectors = [None] * len(prompts)
        with torch.inference_mode():
            for start in range(0, len(order), batch):
                rows = order[start:start + batch]
                width = max(len(prompts[i]) for i in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.long)
                for r, i in enumerate(rows):
                    ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
                    mask[r, :len(prompts[i])] = 1
                out = st({"input_ids": ids, "attention_mask": mask,
                          "token_type_ids": torch.zeros_like(ids)})["sentence_embedding"]
                for r, i in enumerate(rows):
                    vectors[i] = out[r].float().tolist()
        return vectors
    return embed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--model", required=True)
    ap.add_argument("--peer", choices=("vllm", "st"), required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    prompts, _ = read_workload(args.workload)
    make = vllm_embedder if args.peer == "vllm" else st_embedder
    embed = make(args.model, args.dtype, args.batch)
    embed(prompts[:4])  # warm-up
    best = float("inf")
    for _ in range(args.repeat):
        start = time.perf_counter()
        vectors = embed(prompts)
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"seconds": best, "heads": [v[:8] for v in vectors[:4]]}), flush=True)


if __name__ == "__main__":
    main()
