"""Constants and helpers shared by the e2e tests and their server fixture."""
from __future__ import annotations

# Engine arguments shared by the served models and the in-process references, so
# greedy outputs must match token for token. fp32 keeps batched and single-sequence
# numerics close enough that greedy argmax never flips on the random weights.
TINY_ENGINE_ARGS = {"dtype": "float32", "block_size": "16", "num_kv_blocks": "256",
                    "max_num_seqs": "64", "max_model_len": "512", "max_num_batched_tokens": "1024"}
DEFAULT_MODEL_ARGS = {"dtype": "auto", "block_size": "16", "num_kv_blocks": "128",
                      "max_num_seqs": "8", "max_model_len": "1024"}
# The faulty copy fails its 16th step: late enough that three requests sent together
# have all arrived, with one of them WAITING behind FAULTY_MAX_NUM_SEQS running ones.
FAILURE_STEP = 16
FAULTY_MAX_NUM_SEQS = 2


PROMPTS = ["Hello, my name is", "The capital of France is", "Écrire un poème sur la mer:",
           "def fibonacci(n):", "日本の首都は", "1, 2, 3, 4,", "Once upon a time", "Q: 2+2=? A:"]


def greedy(max_tokens: int, **extra):
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)
