"""The load + cancel storm of issue 28 against a real tritonserver: the same prompts run
alone, then as a crowd of concurrent gRPC streams of which every other one is cancelled
mid-stream; each completed stream's text must equal its prompt's alone text.

  python -m bench.bench_invariant_storm                      # SmolLM2, bf16, both modes
  python -m bench.bench_invariant_storm --modes invariant --streams 60

Prints, per mode (batch_invariant true / false, same run): completed, cancelled and
mismatched streams, and the crowd's output tokens/s. A small token budget chunks the
prompts, and their shared system prefix is served from the prefix cache in the crowd.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer
from bench.soak_client import CancelPlan, SoakClient, StreamJob, encode_request, llm_tensors
from kernels.cpu import features as cpu_features

SYSTEM = "You are a helpful assistant. Answer in one short paragraph. "
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about the sea.", "What is 12 times 7?", "Who wrote Hamlet?",
             "Explain photosynthesis simply.", "List the planets of the solar system."]
ENGINE_ARGS = {"model": "", "block_size": "16", "num_kv_blocks": "512", "max_num_seqs": "64",
               "max_model_len": "1024", "max_num_batched_tokens": "256",
               "long_prefill_token_threshold": "24"}


def _job(index: int, prompt: str, max_tokens: int, cancel: bool) -> StreamJob:
    sampling = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    message = encode_request("llm", f"s{index}", llm_tensors(prompt, sampling))
    return StreamJob([message], CancelPlan(after_responses=3) if cancel else None)


async def _run(url: str, prompts: list[str], streams: int, max_tokens: int) -> dict:
    client = SoakClient(url)
    try:
        alone = {}
        for i, prompt in enumerate(prompts):
            job = await client.run(_job(i, prompt, max_tokens, False))
            alone[prompt] = next(iter(job.outcomes.values())).text
        jobs = [_job(i, prompts[i % len(prompts)], max_tokens, i % 2 == 1)
                for i in range(streams)]
        start = time.perf_counter()
        done = await asyncio.gather(*(client.run(j) for j in jobs))
        seconds = time.perf_counter() - start
    finally:
        await client.close()
    completed = cancelled = mismatched = errors = 0
    for i, job in enumerate(done):
        outcome = next(iter(job.outcomes.values()))
        if outcome.error:
            errors += 1
        elif outcome.cancelled:
            cancelled += 1
        else:
            completed += 1
            mismatched += outcome.text != alone[prompts[i % len(prompts)]]
    return {"completed": completed, "cancelled": cancelled, "mismatched": mismatched,
            "errors": errors, "tok_s": completed * max_tokens / seconds}


def run_mode(model: str, dtype: str, invariant: bool, streams: int, max_tokens: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="storm-"))
    params = {**ENGINE_ARGS, "model": model, "dtype": dtype,
              "batch_invariant": str(invariant).lower()}
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=["llm"],
                           params={"llm": params})
    server = TritonServer(repo, ServerPorts.free(), log_path=work / "tritonserver.log",
                          extra_args=["--log-verbose=0", "--exit-timeout-secs=15"])
    server.start()
    try:
        server.wait_ready(timeout=900)
        prompts = [SYSTEM + q for q in QUESTIONS]
        return asyncio.run(_run(server.grpc_url, prompts, streams, max_tokens))
    finally:
        server.stop()
        shutil.rmtree(work / "models", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="invariant,default")
    args = ap.parse_args()
    host = cpu_features.detect().describe()
    for mode in args.modes.split(","):
        r = run_mode(args.model, args.dtype, mode == "invariant", args.streams, args.max_tokens)
        print(f"{args.dtype} batch_invariant={mode == 'invariant'} on {host}: "
              f"{r['completed']} completed, {r['cancelled']} cancelled, {r['errors']} errors, "
              f"{r['mismatched']} mismatched; crowd {r['tok_s']:.1f} output tok/s", flush=True)


if __name__ == "__main__":
    main()
