"""Tensor parallelism's step time on this host: 1 rank vs N ranks (gloo on CPU), for a
decode step of B sequences and a prefill step of one P-token prompt.

    python bench/bench_tp.py                # a random SmolLM2-sized Llama, N = 2
    python bench/bench_tp.py --model PATH --tp 3

The default model has SmolLM2-135M's depth, MLP and vocabulary (30 layers, 1536, 49152)
but 8 heads over 2 KV heads (SmolLM2's 9 heads do not split 2 ways). Each step costs
2 all-reduces per layer plus the embedding's and the logits' gather; on a host with fewer
cores than ranks x threads, ranks also take cores from each other."""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from kernels.cpu import features as cpu_features  # noqa: E402

SMOLLM2_SIZED = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                     tie_word_embeddings=True)


def time_steps(model: str, tp: int, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, num_kv_blocks=1024,
              block_size=16, max_model_len=1024, enable_prefix_caching=False,
              max_num_batched_tokens=max(prompt_len, 512))
    engine = llm.llm_engine
    try:
        prefill_ms = []
        for i in range(steps // 4 + 2):
            ids = [(7919 * (i * prompt_len + j)) % 40000 + 100 for j in range(prompt_len)]
            engine.add_request(f"prefill{i}", ids, SamplingParams(temperature=0, max_tokens=1,
                                                                   ignore_eos=True))
            start = time.perf_counter()
            engine.step()
            prefill_ms.append((time.perf_counter() - start) * 1e3)
        for i in range(batch):
            ids = [(31 * (i * 16 + j)) % 40000 + 100 for j in range(16)]
            engine.add_request(f"decode{i}", ids, SamplingParams(
                temperature=0, max_tokens=steps + 8, ignore_eos=True))
        engine.step()  # every prompt prefilled (16 x batch fits the token budget)
        decode_ms = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            decode_ms.append((time.perf_counter() - start) * 1e3)
        engine.abort_request([f"decode{i}" for i in range(batch)])
    finally:
        engine.close()
    # The first prefills pay one-time costs (kernel set-up, page faults).
    return {"prefill": statistics.median(prefill_ms[2:]), "decode": statistics.median(decode_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: a random SmolLM2-sized Llama)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the decode step")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens in the prefill step")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from testing.tiny_model import make_tiny_model_dir
        model = str(make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="bench-tp-")), "llama",
                                        **SMOLLM2_SIZED))
    print(f"CPU {cpu_features.detect().describe()}; model: {args.model or 'random SmolLM2-sized'}"
          f"; fp32; decode batch {args.batch}, prefill {args.prompt_len} tokens")
    results = {tp: time_steps(model, tp, args.batch, args.prompt_len, args.steps)
               for tp in (1, args.tp)}
    for kind in ("decode", "prefill"):
        one, many = results[1][kind], results[args.tp][kind]
        print(f"{kind:8s} step: 1 rank {one:8.2f} ms   {args.tp} ranks {many:8.2f} ms   "
              f"ratio {many / one:5.2f}x")


if __name__ == "__main__":
    main()
