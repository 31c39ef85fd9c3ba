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
from client_examples.common import build_grpc_inputs, chunk_from_grpc_result
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


def stream_all(url: str, texts: list[str], lengths: list[int],
               stream: bool = True) -> tuple[float, list[int]]:
    """All requests on one gRPC stream (as genai-perf multiplexes them), so the client's
    own CPU use stays small on a machine it shares with the server."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url=url)
    produced = [0] * len(texts)
    pending = set(range(len(texts)))
    errors: list[str] = []
    done = threading.Event()
    lock = threading.Lock()

    def on_response(result, error) -> None:
        with lock:
            if error is not None:
                errors.append(str(error))
                done.set()
                return
            chunk = chunk_from_grpc_result(time.perf_counter(), result)
            index = int(result.get_response().id)
            produced[index] += chunk.num_output_tokens or 0
            if chunk.final:
                pending.discard(index)
                if not pending:
                    done.set()

    client.start_stream(callback=on_response)
    t0 = time.perf_counter()
    for i, (text, n) in enumerate(zip(texts, lengths)):
        sampling = {"temperature": 0, "max_tokens": n, "min_tokens": n, "ignore_eos": True}
        client.async_stream_infer("llm", build_grpc_inputs(text, sampling, stream=stream,
                                                           return_flags=("return_num_output_tokens",)),
                                  request_id=str(i),
                                  enable_empty_final_response=True)
    done.wait(timeout=1800)
    elapsed = time.perf_counter() - t0
    client.stop_stream()
    client.close()
    if errors or pending:
        raise RuntimeError(f"{len(errors)} errors, {len(pending)} unfinished; first: "
                           f"{errors[0] if errors else 'timeout'}")
    return elapsed, produced


def through_triton(texts: list[str], lengths: list[int]) -> tuple[float, float, float]:
    """(streaming tok/s, non-streaming tok/s, seconds from start to ready)"""
    from backend.triton_server import ServerPorts, TritonServer
    log = Path(tempfile.mkdtemp(prefix="bench-triton-")) / "server.log"
    server = TritonServer(REPO, ServerPorts.free(), log_path=log,
                          extra_args=["--model-control-mode=explicit", "--load-model=llm"])
    server.start()
    try:
        ready_s = server.wait_ready(900)
        stream_all(server.grpc_url, texts[:2], [4, 4])  # warm-up
        rates = []
        for stream in (True, False):
            elapsed, produced = stream_all(server.grpc_url, texts, lengths, stream)
            if produced != lengths:
                raise RuntimeError("the server returned other output lengths than requested")
            rates.append(sum(lengths) / elapsed)
        return rates[0], rates[1], ready_s
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["fixed", "variable"], default="fixed")
    args = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    w = make_workload(args.workload, tok)
    texts = [tok.decode(p) for p in w.prompts]
    inproc = in_process(texts, w.max_tokens)
    streaming, whole, ready_s = through_triton(texts, w.max_tokens)
    print(f"\n{args.workload} workload, {len(texts)} requests, {sum(w.max_tokens)} output tokens")
    print(f"{'in-process LLM.generate':<30}{inproc:>9.1f} tok/s")
    print(f"{'Triton gRPC, streaming':<30}{streaming:>9.1f} tok/s   ({streaming / inproc:.0%} of in-process)")
    print(f"{'Triton gRPC, one response':<30}{whole:>9.1f} tok/s   ({whole / inproc:.0%} of in-process)")
    print(f"server start to ready: {ready_s:.1f} s")


if __name__ == "__main__":
    main()
