"""Output tokens/s through Triton (gRPC streaming, `llm` model) vs in-process
LLM.generate, same 64-request workload, one after the other in one run.

  python -m bench.bench_triton [--workload fixed|variable]

The server runs the repository's `llm` model as shipped (embedded SmolLM2, bf16,
max_num_seqs 64, max_model_len 2048); the in-process engine gets the same arguments.
Every request asks for exactly its output length (min_tokens = max_tokens, ignore_eos).
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import threading
import time
from pathlib import Path

from bench.bench_generate import make_workload
from client_examples.common import GrpcStreamSession
from engine import LLM, SamplingParams
from engine.models import default_model_dir

REPO = Path(__file__).resolve().parent.parent / "model_repository"


def in_process(texts: list[str], lengths: list[int]) -> float:
    llm = LLM(None, dtype="bfloat16", max_num_seqs=64, max_model_len=2048)
    llm.generate(texts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
              for n in lengths]
    t0 = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    del llm, outs
    gc.collect()
    return sum(lengths) / elapsed


def through_triton(texts: list[str], lengths: list[int]) -> tuple[float, float]:
    from backend.triton_server import ServerPorts, TritonServer
    log = Path(tempfile.mkdtemp(prefix="bench-triton-")) / "server.log"
    server = TritonServer(REPO, ServerPorts.free(), log_path=log,
                          extra_args=["--model-control-mode=explicit", "--load-model=llm"])
    t_start = time.perf_counter()
    server.start()
    try:
        ready_s = server.wait_ready(900)
        sessions = [GrpcStreamSession(server.grpc_url, "llm") for _ in texts]
        sessions[0].generate(texts[0], {"temperature": 0, "max_tokens": 4})  # warm-up
        produced = [0] * len(texts)
        errors: list[str] = []

        def run(i: int) -> None:
            n = lengths[i]
            record = sessions[i].generate(texts[i], {"temperature": 0, "max_tokens": n,
                                                     "min_tokens": n, "ignore_eos": True})
            if record.error:
                errors.append(record.error)
            produced[i] = sum(c.num_output_tokens or 0 for c in record.chunks)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        for s in sessions:
            s.close()
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]} (log: {log})")
        if produced != lengths:
            raise RuntimeError("the server returned other output lengths than requested")
        return sum(lengths) / elapsed, ready_s
    finally:
        server.stop()
        print(f"(server log: {log}; start to ready {time.perf_counter() - t_start:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["fixed", "variable"], default="fixed")
    args = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    w = make_workload(args.workload, tok)
    texts = [tok.decode(p) for p in w.prompts]
    inproc = in_process(texts, w.max_tokens)
    triton, ready_s = through_triton(texts, w.max_tokens)
    print(f"\n{args.workload} workload, {len(texts)} requests, {sum(w.max_tokens)} output tokens")
    print(f"{'in-process LLM.generate':<28}{inproc:>9.1f} tok/s")
    print(f"{'Triton gRPC streaming':<28}{triton:>9.1f} tok/s   ({triton / inproc:.0%} of in-process)")
    print(f"server start to ready: {ready_s:.1f} s")


if __name__ == "__main__":
    main()
