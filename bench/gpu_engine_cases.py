"""Engine-level cases, run in child processes: greedy agreement device vs CPU, and
end-to-end tokens/s against HF transformers `generate` and the weights-per-token roofline.

Greedy runs on random weights sit near ties often (logits of a random model are nearly
flat), so a divergence alone proves nothing: at the first differing token the CPU run's
logit margin between its choice and the device's choice is reported, and only a margin
above the dtype's rounding noise fails the case.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from bench.gpu_models import (LLAMA_1B, SMOLLM2_135M, TINY_1B, TINY_SMOLLM2, LlamaShape,
                              build_llama, random_prompts, save_model_folder, weight_bytes)
from bench.gpu_report import Case, Outcome

# tag -> (dtype, enforce_eager): the eager run tells a CUDA-graph fault from a kernel one.
GREEDY_RUNS = {"fp32": ("float32", False), "bf16": ("bfloat16", False),
               "fp32 eager": ("float32", True)}
# Largest CPU-side logit gap (between its token and the device's) still called a near tie:
# fp32 logits of the two backends agree to ~1e-4; bf16 ones drift by ~0.1 over 30 layers.
NEAR_TIE = {"float32": 0.01, "bfloat16": 0.5}
THROUGHPUT_BATCHES = (1, 64)


def greedy_case_name(tag: str) -> str:
    return f"engine greedy {tag} vs CPU"


def throughput_case_name(batch: int) -> str:
    return f"e2e tokens/s B={batch}"


@dataclass(frozen=True, slots=True)
class EngineSettings:
    device: str
    rehearse: bool
    workdir: Path

    @property
    def greedy_shape(self) -> LlamaShape:
        return TINY_SMOLLM2 if self.rehearse else SMOLLM2_135M

    @property
    def throughput_shape(self) -> LlamaShape:
        return TINY_1B if self.rehearse else LLAMA_1B


def _free_memory() -> None:
    """Called once the last reference is dropped: engines hold cycles, and the caching
    allocator keeps freed blocks, so both are collected before the next model loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compiled_variants() -> int | None:
    """Compiled variants of the attention kernels so far (None under the interpreter):
    serving after the engine's warm-up should add none."""
    from kernels.triton import cache as triton_cache
    from kernels.triton import decode as triton_decode
    from kernels.triton import prefill as triton_prefill
    kernels = (triton_decode.decode_partition_kernel, triton_decode.decode_reduce_kernel,
               triton_prefill.prefill_attention_kernel, triton_cache.reshape_and_cache_kernel)
    if not all(hasattr(k, "device_caches") for k in kernels):
        return None
    return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())


# ---------------------------------------------------------------- greedy agreement
Run = tuple[list[int], list[dict[int, float]]]  # token ids, top logprobs at each step


def greedy_verdict(cpu: list[Run], device: list[Run], near_tie: float) -> tuple[bool, str]:
    """(every divergence is a near tie, description) for two greedy runs of the same prompts."""
    worst, where = 0.0, []
    for index, ((cpu_ids, cpu_lps), (dev_ids, _)) in enumerate(zip(cpu, device)):
        first = next((j for j, (a, b) in enumerate(zip(cpu_ids, dev_ids)) if a != b), None)
        if first is None and len(cpu_ids) == len(dev_ids):
            continue
        if first is None:
            worst = math.inf
            where.append(f"p{index} length {len(cpu_ids)} vs {len(dev_ids)}")
            continue
        top = cpu_lps[first]
        # A token outside the CPU's top k is no near tie, whatever the exact gap.
        margin = top[cpu_ids[first]] - top.get(dev_ids[first], math.inf)
        worst = max(worst, margin if math.isfinite(margin) else math.inf)
        where.append(f"p{index}@{first}")
    detail = f"{len(cpu) - len(where)}/{len(cpu)} prompts identical ({len(cpu[0][0])} tokens)"
    if where:
        shown = f"{worst:.3g}" if math.isfinite(worst) else "inf"
        detail += f"; first divergence {', '.join(where)}, max margin {shown}"
    return worst <= near_tie, detail


@dataclass(slots=True)
class GreedyJob:
    settings: EngineSettings
    log: Callable[[str], None] = print
    _model_dir: Path | None = None

    def model_dir(self) -> Path:
        if self._model_dir is None:
            model = build_llama(self.settings.greedy_shape, "cpu", torch.float32, init_std=0.05)
            self._model_dir = save_model_folder(model, self.settings.workdir / "greedy-model")
            self.log(f"built a random {self.settings.greedy_shape.label} model")
            del model
            _free_memory()
        return self._model_dir

    def cases(self) -> list[Case]:
        return [Case(greedy_case_name(tag), lambda run=run: self.agreement(*run))
                for tag, run in GREEDY_RUNS.items()]

    def agreement(self, dtype: str, enforce_eager: bool) -> Outcome:
        from engine import SamplingParams
        shape = self.settings.greedy_shape
        prompts = random_prompts(4, [5, 17, 40, 100], shape.vocab_size, seed=1)
        params = SamplingParams(max_tokens=8 if self.settings.rehearse else 24, temperature=0.0,
                                ignore_eos=True, logprobs=5)
        cpu, _ = self._generate(dtype, "cpu", prompts, params, False)
        self.log(f"{dtype} on cpu done")
        dev, how = self._generate(dtype, self.settings.device, prompts, params, enforce_eager)
        good, detail = greedy_verdict(cpu, dev, NEAR_TIE[dtype])
        detail += f"; {how}"
        if self.settings.device == "cpu":
            detail += " [rehearsal: CPU vs CPU]"
        return Outcome("PASS" if good else "FAIL", detail)

    def _generate(self, dtype: str, device: str, prompts, params, enforce_eager: bool):
        from engine import LLM
        llm = LLM(str(self.model_dir()), dtype=dtype, device=device, max_model_len=256,
                  max_num_batched_tokens=256, max_num_seqs=8, num_kv_blocks=64,
                  enforce_eager=enforce_eager)
        runner = llm.llm_engine.runner
        if runner.device.type != torch.device(device).type:
            raise RuntimeError(f"engine asked for {device} ran on {runner.device}")
        compiled = compiled_variants()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        graphs = runner.decode_graphs.captured if runner.decode_graphs is not None else []
        how = f"CUDA graphs {graphs}" if graphs else "eager"
        if compiled is not None:
            how += f", {compiled_variants() - compiled} Triton compiles after warm-up"
        del llm, runner
        _free_memory()
        return [(list(o.outputs[0].token_ids),
                 [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outputs], how


# ---------------------------------------------------------------- throughput
@dataclass(slots=True)
class ThroughputJob:
    settings: EngineSettings
    peak_bytes_per_s: float
    log: Callable[[str], None] = print
    _hf: object | None = None
    _llm: object | None = None
    _weight_bytes: int = 0
    _prompt_len: int = field(init=False)
    _new_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self._prompt_len, self._new_tokens = (8, 8) if self.settings.rehearse else (128, 128)

    @property
    def dtype(self) -> torch.dtype:
        # bf16 is what a GPU serves; a CPU without native bf16 would only measure emulation.
        return torch.float32 if self.settings.device == "cpu" else torch.bfloat16

    def cases(self) -> list[Case]:
        return [Case(throughput_case_name(b), lambda b=b: self.measure(b))
                for b in THROUGHPUT_BATCHES]

    def _models(self):
        if self._hf is None:
            from engine import LLM
            device, shape = self.settings.device, self.settings.throughput_shape
            self._hf = build_llama(shape, device, self.dtype, seed=2)
            self._weight_bytes = weight_bytes(self._hf)
            folder = save_model_folder(self._hf, self.settings.workdir / "throughput-model")
            self.log(f"built and saved a random {shape.label} model "
                     f"({self._weight_bytes / 1e9:.3g} GB); each run: {self._prompt_len} prompt "
                     f"+ {self._new_tokens} new tokens per sequence")
            self._llm = LLM(str(folder), dtype=str(self.dtype).removeprefix("torch."),
                            device=device, max_model_len=2 * (self._prompt_len + self._new_tokens),
                            max_num_seqs=max(THROUGHPUT_BATCHES), enable_prefix_caching=False,
                            max_num_batched_tokens=256 if self.settings.rehearse else 2048)
            self.log("engine loaded")
        return self._hf, self._llm

    def measure(self, batch: int) -> Outcome:
        hf, llm = self._models()
        vocab = self.settings.throughput_shape.vocab_size
        warm = random_prompts(batch, [self._prompt_len], vocab, seed=100 + batch)
        prompts = random_prompts(batch, [self._prompt_len], vocab, seed=batch)
        hf_rate = self._hf_rate(hf, warm, prompts)
        self.log(f"HF generate B={batch}: {hf_rate:,.0f} tok/s")
        engine_rate = self._engine_rate(llm, warm, prompts)
        roofline = batch * self.peak_bytes_per_s / self._weight_bytes
        detail = (f"engine {engine_rate:,.0f} tok/s, HF {hf_rate:,.0f} "
                  f"({engine_rate / hf_rate:.2f}x), roofline {roofline:,.0f} "
                  f"({engine_rate / roofline:.1%})")
        if batch == THROUGHPUT_BATCHES[-1]:
            del hf, llm
            self._hf = self._llm = None
            _free_memory()
        return Outcome("OK", detail)

    def _sync(self) -> None:
        if self.settings.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _hf_rate(self, model, warm, prompts) -> float:
        def generate(ids, new_tokens):
            tokens = torch.tensor(ids, device=self.settings.device)
            with torch.no_grad():
                out = model.generate(tokens, attention_mask=torch.ones_like(tokens),
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, pad_token_id=0)
            return out.shape[1] - tokens.shape[1]
        generate(warm, 4)
        self._sync()
        started = time.perf_counter()
        made = generate(prompts, self._new_tokens)
        self._sync()
        if made != self._new_tokens:
            raise RuntimeError(f"HF generated {made} tokens, expected {self._new_tokens}")
        return len(prompts) * made / (time.perf_counter() - started)

    def _engine_rate(self, llm, warm, prompts) -> float:
        from engine import SamplingParams
        # The warm-up batch has the same size, so every kernel specialization the timed
        # run needs is compiled before the clock starts.
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        params = SamplingParams(max_tokens=self._new_tokens, temperature=0.0, ignore_eos=True)
        self._sync()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        self._sync()
        elapsed = time.perf_counter() - started
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        if made != len(prompts) * self._new_tokens:
            raise RuntimeError(f"engine generated {made} tokens, expected "
                               f"{len(prompts) * self._new_tokens}")
        return made / elapsed
