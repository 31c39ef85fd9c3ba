"""Accuracy of the GGUF-quantized path (quantization="gguf") on the embedded SmolLM2 file:
greedy agreement with HF float32 on the dequantized weights (32 tokens x 8 prompts) and
perplexity on a fixed text, next to the dense engine path and llama.cpp on the same file.

  .venv/bin/python -m bench.bench_gguf_quality [--llamacpp-python /tmp/llama-venv/bin/python]
                                               [--skip-hf-perplexity]

"token match": fraction of the 256 generated positions whose id equals HF's; "same prefix":
mean length of the identical leading run. Perplexity = exp(mean NLL of token t+1 given
tokens <= t) over the text's ids (the same ids everywhere: both tokenizers read the GGUF).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile

import torch

from engine import LLM, SamplingParams
from engine.models import default_model_dir
from engine.models.gguf_cache import default_gguf_path
from kernels.cpu import features as cpu_features
from testing.model_batch import PagedBatchBuilder

MAX_TOKENS = 32
PROMPTS = ["The capital of France is", "Here is a recipe for pancakes:", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three laws of thermodynamics are",
           "Translate to French: I love reading books.", "List three colours:", "Water boils at"]
TEXT = """\
Water moves around the planet in a loop that has no beginning and no end. The sun warms the \
surface of the oceans, lakes and rivers, and a small part of that water rises into the air as \
vapour. Plants add their share as well, releasing moisture through tiny openings in their \
leaves. As the warm, damp air climbs higher, it cools, and the vapour gathers around specks of \
dust and salt to form droplets. Billions of these droplets together make a cloud. When the \
droplets grow heavy enough, they fall back to the ground as rain, or as snow and hail when the \
air is cold. Some of that water soaks into the soil and slowly seeps down to fill the spaces \
between rocks, where it may stay for hundreds or even thousands of years. Some runs across the \
land in streams that join into rivers, and the rivers carry it back to the sea. Snow that \
settles on high mountains can be packed into glaciers, which hold water for a very long time \
before they melt. In this way the same water has been used again and again since the earth \
was young, and the glass of water on a kitchen table may once have fallen on a forest, \
drifted in a cloud over a desert, or lain frozen at the bottom of an ancient ice sheet.

People have always depended on this cycle. Early farmers settled near rivers that flooded \
each year and left rich mud on their fields. Towns grew where fresh water was easy to reach, \
and engineers learned to build wells, canals and aqueducts to carry water over long \
distances. When the rains failed, harvests failed with them, and whole communities were \
forced to move. Today scientists measure rainfall, river levels and the depth of underground \
water with great care, because a change in any part of the cycle can affect the food, health \
and comfort of millions of people.

The history of printing is a story of patience and invention. For many centuries, books were \
copied by hand, one letter at a time, usually by scribes working in quiet rooms with ink, \
quills and sheets of prepared animal skin. A single large book could take months or years to \
finish, so books were rare and expensive, and only a few people ever owned one. In East Asia, \
craftsmen carved whole pages into blocks of wood, covered the raised surface with ink and \
pressed paper against it. This method made it possible to produce many copies of the same \
text, and some printed scrolls survive from more than a thousand years ago. Later, printers \
in China and Korea experimented with movable pieces made of clay, wood and metal, each piece \
carrying a single character.

In Europe, the printing press that appeared in the middle of the fifteenth century combined \
several older ideas into one practical machine. Metal letters were cast in moulds so that \
each one had exactly the same height, and they could be arranged in a frame, inked, printed \
and then taken apart to be used again. A screw press, similar to those used for making wine \
and oil, pressed the paper evenly against the type. With this system a small workshop could \
print hundreds of pages in a single day. Within a few decades, presses were working in many \
cities, and the price of books fell sharply. More people learned to read, new ideas spread \
quickly from one country to another, and scholars could compare identical copies of the same \
work. Newspapers, pamphlets and cheap schoolbooks followed. Over the next centuries the press \
was powered by steam and then by electricity, paper was made from wood instead of rags, and \
machines learned to set type automatically, yet the basic idea remained the same: prepare \
the words once, and repeat them as many times as readers need.
"""


def match_stats(got: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions equal to ref, mean length of the common prefix)."""
    same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
    prefixes = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
                for g, r in zip(got, ref)]
    return same / sum(len(r) for r in ref), sum(prefixes) / len(prefixes)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] under logits[:-1] (float32 logits, float64 softmax)."""
    logp = torch.log_softmax(logits[:len(ids) - 1].double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return math.exp(float(nll.mean()))


def all_logits(loaded, ids: list[int]) -> torch.Tensor:
    """The engine model's logits at every position of one prefill of `ids`."""
    builder = PagedBatchBuilder(block_size=16, num_blocks=len(ids) // 16 + 2)
    kv = builder.new_kv_caches(loaded, loaded.dtype)
    tokens, positions, meta = builder.build([("S", ids, 0)])
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(tokens, positions, kv, meta)).float()


def new_llm(**kwargs) -> LLM:
    return LLM(None, dtype="float32", max_model_len=2048, num_kv_blocks=512, **kwargs)


def run_engine(llm: LLM, prompts: list[list[int]], text: list[int]):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            perplexity(all_logits(llm.llm_engine.loaded, text), text))


def run_hf(prompts: list[list[int]], text: list[int], with_ppl: bool):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    with torch.inference_mode():
        greedy = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        ppl = perplexity(model(torch.tensor([text])).logits[0].float(), text) if with_ppl else None
    return greedy, ppl


def run_llamacpp(python: str, prompts: list[list[int]], text: list[int]) -> dict:
    job = {"gguf": str(default_gguf_path()), "prompts": prompts, "max_tokens": MAX_TOKENS,
           "text": text}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(job, f)
        f.flush()
        peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_quality_peer.py")
        out = subprocess.run([python, peer, f.name], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"llama.cpp peer failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-python", help="python of a llama-cpp-python venv")
    parser.add_argument("--skip-hf-perplexity", action="store_true")
    args = parser.parse_args()

    dense = new_llm()
    tok = dense.get_tokenizer()
    prompts, text = [tok.encode(p) for p in PROMPTS], tok.encode(TEXT)
    weights = default_gguf_path().stem.rsplit(".", 1)[-1]  # the file's name: ...Q4_1.gguf
    rows = [("engine float32", *run_engine(dense, prompts, text))]
    del dense
    rows.append((f"engine gguf ({weights})",
                 *run_engine(new_llm(quantization="gguf"), prompts, text)))
    if args.llamacpp_python and os.path.exists(args.llamacpp_python):
        peer = run_llamacpp(args.llamacpp_python, prompts, text)
        rows.append((f"llama.cpp {peer['weights']} file", peer["greedy"],
                     math.exp(peer["mean_nll"])))
    elif args.llamacpp_python:
        print(f"(no llama.cpp row: {args.llamacpp_python} not found)")
    hf_greedy, hf_ppl = run_hf(prompts, text, not args.skip_hf_perplexity)

    print(f"CPU {cpu_features.detect().describe()}; SmolLM2-135M-Instruct, greedy "
          f"{MAX_TOKENS} tokens x {len(prompts)} prompts vs HF float32 on the dequantized weights")
    print(f"{'':22} {'token match':>11}   {'same prefix':>11}   perplexity ({len(text)} tokens)")
    for name, greedy, ppl in rows:
        match, prefix = match_stats(greedy, hf_greedy)
        print(f"{name:22} {match:>11.1%}   {prefix:>11.1f}   {ppl:>10.3f}")
    print(f"{'HF float32':22} {'-':>11}   {'-':>11}   "
          + (f"{hf_ppl:>10.3f}" if hf_ppl is not None else f"{'skipped':>10}"))


if __name__ == "__main__":
    main()
