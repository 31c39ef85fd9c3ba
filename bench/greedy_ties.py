"""Where greedy runs at a low precision part from float32, and how close float32's two best
tokens were there: the engine and HF transformers at --dtype, each against HF at float32,
over bench_generate's workload prompts.

    PYTHONPATH=. python -m bench.greedy_ties [--dtype bfloat16] [--prompts 8] [--tokens 32]

A parting where float32's top two logits are closer than the low precision can resolve is
a near-tie, not a fault; the engine parting where HF at the same dtype does not, at a wide
margin, would be one. bench_generate's "greedy ids agree" lines compare its first prompt
only.
"""
from __future__ import annotations

import argparse

import torch

from kernels.cpu import features as cpu_features

cpu_features.detect()  # before the first tensor op (the caps reach oneDNN at its first use)

from bench.bench_generate import make_workload, resolve_model_dir  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where the two differ; the shorter length where one is a prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def hf_greedy(model, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy ids, and at each step the gap between its two best logits (float32)."""
    ids, out, gaps = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(tokens):
            top = model(ids).logits[0, -1].float().topk(2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    return out, gaps


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workload", default="fixed", choices=("fixed", "variable"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048)
    prompts = make_workload(args.workload, llm.get_tokenizer(), count=args.prompts).prompts
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens,
                                                ignore_eos=True), use_tqdm=False)
    folder = resolve_model_dir(args.model)
    hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_low = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    print(f"CPU {cpu_features.detect().describe()}; {args.prompts} {args.workload} prompts x "
          f"{args.tokens} greedy tokens; gap = float32's top-2 logit gap where a run parts")
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, gaps = hf_greedy(hf32, prompt, args.tokens)
        low, _ = hf_greedy(hf_low, prompt, args.tokens)
        cells = []
        for label, ids in ((f"engine {args.dtype}", list(out.outputs[0].token_ids)),
                           (f"HF {args.dtype}", low)):
            at = first_difference(ids, ref)
            gap = f", gap {gaps[at]:.3f}" if at < args.tokens else ""
            cells.append(f"{label} {at}/{args.tokens}{gap}")
        print(f"prompt {i}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
