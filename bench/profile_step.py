"""Where an engine step's CPU time goes, by part, on bench_generate's workloads.

  python -m bench.profile_step --workload fixed|variable [--num-prompts N] [--threads 1]
  python -m bench.profile_step --workload fixed --lora-adapters 4 [--lora-rank 16]
      (bench_generate's LoRA workload: random adapters + the base, round-robin)
  python -m bench.profile_step ... --threads 2 --wall

Runs the workload through LLM.generate with each part of a step (the model's kernels
through kernels.dispatch, input preparation, sampling, scheduler, output processing)
wrapped in a timer of the engine thread's CPU time (time.thread_time), exclusive of the
parts nested in it. At one thread every kernel runs on that thread, so the figures do
not count time the host's other processes took from us, which wall time on a shared
host does. Steps are split by kind: decodes only, or with prefill rows. --wall times by
the wall clock instead: at several threads a kernel's other threads work while the engine
thread waits, and only the wall clock sees that (it also sees the host's other load).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from functools import wraps
from pathlib import Path

import torch

from bench.bench_generate import make_workload
from bench.lora_workload import engine_lora_args, make_adapters, per_request
from engine import LLM, SamplingParams
from engine.lora.runtime import LoRARuntime
from engine.models import attention as model_attention
from engine.models import layers as model_layers
from engine.models import rope as model_rope
from engine.models.llama import LlamaForCausalLM, LlamaModel
from engine.models.lora_linear import LoRALinear
from engine.sample.sampler import Sampler
from engine.worker.model_runner import ModelRunner
from kernels import dispatch
from kernels.cpu import features as cpu_features


class PartTimer:
    """Exclusive time per part by `clock` (the engine thread's CPU time by default); the
    current step's figures go to its kind at its end."""

    def __init__(self, clock=time.thread_time) -> None:
        self.clock = clock
        self.unit = "CPU" if clock is time.thread_time else "wall"
        self.stack: list[list] = []  # [part, start, nested time]
        self.step: dict[str, float] = defaultdict(float)
        self.kind = "decode"
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)

    def wrap(self, part, fn):
        @wraps(fn)
        def timed(*args, **kwargs):
            name = part(self) if callable(part) else part
            frame = [name, self.clock(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - frame[1]
                self.stack.pop()
                self.step[name] += elapsed - frame[2]
                if self.stack:
                    self.stack[-1][2] += elapsed
                if name == "step (engine glue)":
                    self._end_step()
        return timed

    def _end_step(self) -> None:
        totals = self.totals[self.kind]
        for name, seconds in self.step.items():
            totals[name] += seconds
        self.steps[self.kind] += 1
        self.step.clear()
        self.kind = "decode"

    def report(self) -> None:
        for kind, parts in self.totals.items():
            total = sum(parts.values())
            steps = self.steps[kind]
            print(f"\n{kind}: {steps} steps, {self.tokens[kind]} scheduled tokens, "
                  f"{total:.2f} s {self.unit} = {1e3 * total / max(steps, 1):.2f} ms/step")
            for name, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
                print(f"  {name:<28}{1e3 * seconds / max(steps, 1):>10.3f} ms/step"
                      f"{100 * seconds / total:>8.1f}%")


def _linear_part(timer: PartTimer) -> str:
    return "matmul lm_head" if timer.stack and timer.stack[-1][0] == "logits" else "matmul"


def _wrap_dispatch(name: str, wrapper) -> None:
    # The engine calls kernels.dispatch.NAME; dispatch's own modules call one another by
    # their module's name (gate_up_silu -> linear, silu_mul): both must see the wrapper.
    module = sys.modules[getattr(dispatch, name).__module__]
    setattr(dispatch, name, wrapper)
    setattr(module, name, wrapper)


def install(timer: PartTimer) -> None:
    """Wrap the parts of a step; the wrappers call the real functions unchanged."""
    w = timer.wrap
    _wrap_dispatch("linear", w(_linear_part, dispatch.linear))
    # The MLP's gate_up matmul ending in silu_mul (AMX tiles); where it does not fuse, its
    # two halves land under "matmul" and "silu_mul" as before.
    _wrap_dispatch("gate_up_silu", w("matmul gate_up+silu", dispatch.gate_up_silu))
    for name in ("add_rms_norm", "silu_mul", "rope", "argmax_rows"):
        _wrap_dispatch(name, w(name, getattr(dispatch, name)))
    model_attention.paged_attention = w("attention", model_attention.paged_attention)
    model_attention.reshape_and_cache = w("kv write", model_attention.reshape_and_cache)
    model_rope.RotaryEmbedding.lookup = w("rope", model_rope.RotaryEmbedding.lookup)
    LlamaModel.embed = w("embed", LlamaModel.embed)
    LlamaModel.forward = w("model (python)", LlamaModel.forward)
    LlamaForCausalLM.compute_logits = w("logits", LlamaForCausalLM.compute_logits)
    model_layers.Linear.forward = w("model (python)", model_layers.Linear.forward)
    prepare = ModelRunner._prepare

    def prepare_and_classify(runner, out):
        result = prepare(runner, out)
        timer.kind = "decode" if result[2].max_query_len == 1 else "with prefill"
        timer.tokens[timer.kind] += out.total_num_scheduled_tokens
        return result

    _wrap_dispatch("lora_add", w("lora update", dispatch.lora_add))
    LoRALinear.forward = w("model (python)", LoRALinear.forward)
    LoRARuntime.set_step = w("lora plan", LoRARuntime.set_step)
    ModelRunner._prepare = w("input prep", prepare_and_classify)
    ModelRunner.execute = w("runner (python)", ModelRunner.execute)
    Sampler.prepare = w("sampling metadata", Sampler.prepare)
    Sampler.__call__ = w("sampling", Sampler.__call__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["fixed", "variable"], default="fixed")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true",
                    help="time parts by the wall clock, not the engine thread's CPU time")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lora-adapters", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-max-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="new tokens per request (0: the workload's, or --lora-max-tokens)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lora_args = {} if not args.lora_adapters else engine_lora_args(args.lora_adapters,
                                                                   args.lora_rank)
    llm = LLM(None, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=2048,
              max_model_len=2048, num_threads=args.threads, **lora_args)
    w = make_workload(args.workload, llm.get_tokenizer(), count=args.num_prompts)
    tmp = tempfile.TemporaryDirectory() if args.lora_adapters else None
    loras = None if tmp is None else _lora_requests(w, args, Path(tmp.name))
    if args.max_tokens:
        w.max_tokens = [args.max_tokens] * len(w.prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.max_tokens]
    llm.generate(w.prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()
    timer = PartTimer(time.perf_counter if args.wall else time.thread_time)
    install(timer)
    engine = llm.llm_engine
    engine.step = timer.wrap("step (engine glue)", engine.step)
    engine.scheduler.schedule = timer.wrap("scheduler", engine.scheduler.schedule)
    engine.scheduler.update_from_output = timer.wrap("scheduler",
                                                     engine.scheduler.update_from_output)
    engine.output_processor.process = timer.wrap("outputs", engine.output_processor.process)
    t0, c0 = time.perf_counter(), time.thread_time()
    llm.generate(w.prompts, params, use_tqdm=False, lora_request=loras)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    print(f"CPU {cpu_features.detect().describe()}, threads={args.threads}, "
          f"dtype={engine.loaded.dtype}, workload {args.workload} x {len(w.prompts)}")
    print(f"{w.total_output} output tokens: {cpu:.1f} s CPU of the engine thread, {wall:.1f} s "
          f"wall ({w.total_output / cpu:.1f} tok per CPU second)")
    timer.report()
    if tmp is not None:
        print(f"LoRA: {args.lora_adapters} adapters of rank {args.lora_rank} + the base, "
              f"round-robin over {len(w.prompts)} requests x {w.max_tokens[0]} tokens")
        tmp.cleanup()


def _lora_requests(w, args, folder: Path) -> list:
    """bench_generate's LoRA workload on `w` (bench/lora_workload.py), its adapters written
    under `folder`: each request's adapter, or None for the base."""
    from engine.models import resolve_model_dir

    requests = make_adapters(resolve_model_dir(None), folder, args.lora_adapters, args.lora_rank)
    w.max_tokens = [args.lora_max_tokens] * len(w.prompts)
    return per_request(requests, len(w.prompts))[1]


if __name__ == "__main__":
    main()
