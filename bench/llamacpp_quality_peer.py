"""llama.cpp side of bench_gguf_quality.py: greedy ids and perplexity on one GGUF file.
Runs in the llama-cpp-python venv (see llamacpp_peer.py for the recipe), never imports
this project.

Usage: VENV/bin/python bench/llamacpp_quality_peer.py JOB.json
JOB.json = {"gguf": path, "prompts": [[ids], ...], "max_tokens": n, "text": [ids]}
Prints one JSON line: {"version", "weights", "greedy": [[ids], ...], "mean_nll"}.
"""
import json
import sys

import numpy as np


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import llama_cpp
    from gguf import LlamaFileType
    llm = llama_cpp.Llama(job["gguf"], n_ctx=2048, logits_all=True, n_threads=2,
                          n_threads_batch=2, seed=0, verbose=False)
    greedy = []
    for prompt in job["prompts"]:  # exactly max_tokens each, EOS ignored
        llm.reset()
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) == job["max_tokens"]:
                break
        greedy.append(out)

    ids = job["text"]
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)  # predicts ids[1:]
    peak = logits.max(axis=1, keepdims=True)
    log_z = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
    nll = log_z - logits[np.arange(len(ids) - 1), ids[1:]]
    weights = LlamaFileType(int(llm.metadata.get("general.file_type", 0))).name
    print(json.dumps({"version": llama_cpp.__version__,
                      "weights": weights.removeprefix("MOSTLY_").removeprefix("ALL_"),
                      "greedy": greedy, "mean_nll": float(nll.mean())}), flush=True)


if __name__ == "__main__":
    main()
