"""EngineConfig: the whole configuration, built once from flat engine arguments."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.config.cache import CacheConfig
from engine.config.checks import check_positive
from engine.config.generation import check_generation_config, parse_override
from engine.config.kv_events import KVEventsConfig
from engine.config.lora import LoRAConfig
from engine.config.runner import check_runner_args
from engine.config.scheduler import SchedulerConfig
from engine.config.speculative import SpeculativeConfig
from engine.values import convert

DTYPES = ("bfloat16", "float32", "float16", "auto")
QUANTIZATIONS = (None, "gguf")
MODEL_IMPLS = ("auto", "native", "transformers")


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs. Built from keyword args (LLM(...)), CLI flags or
    config.pbtxt string parameters through `from_dict`; nothing re-parses later."""
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None
    # "auto": bf16 where the CPU computes it natively (AMX, AVX-512 BF16), else float32;
    # on a GPU, the checkpoint's half dtype (models/loader.py resolve_dtype).
    dtype: str = "auto"
    # None: weights in `dtype`. "gguf": a .gguf model's Q4_0/Q4_1/Q8_0 tensors stay in
    # their blocks and run through the int8-dot CPU kernel (kernels/cpu/linear_quant.c).
    quantization: str | None = None
    # "auto": CUDA when torch sees a GPU (Triton kernels), else the CPU (C/torch kernels).
    device: str = "auto"
    seed: int = 0
    max_logprobs: int = 20
    # 0: every CPU the process may use (affinity, cgroup quota), fewer while other
    # processes keep some of them busy (engine/worker/cpu_threads.py); N: exactly N threads.
    num_threads: int = 0
    # vLLM's name: on a GPU, no CUDA graphs (decode steps launch kernel by kernel).
    enforce_eager: bool = False
    # vLLM's name: ranks that each hold 1/N of every layer's heads, MLP columns and vocab
    # (engine/distributed/); rank 0 is this process, N - 1 workers are spawned. 1: no workers.
    tensor_parallel_size: int = 1
    # vLLM's name: with tensor_parallel_size N, an MoE model's ranks each hold E/N whole
    # experts (the first E % N ranks one more) instead of 1/N of every expert; attention
    # stays split by heads. No effect with N = 1; ignored (logged) for a dense model.
    enable_expert_parallel: bool = False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # vLLM's enable_lora, max_loras, max_lora_rank, max_cpu_loras (flat engine args).
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # JSON Lines workload trace (engine/metrics/trace.py) for the replay and the tuner (tune/);
    # None: off. Past trace_max_bytes the file moves to <path>.1 and a new one begins.
    trace_path: str | None = None
    trace_max_bytes: int = 64 * 1024**2
    # vLLM's KV-cache events (engine/core/kv_cache/publisher.py) for prefix-aware routers; None: off.
    kv_events_config: KVEventsConfig | None = None
    # Which of several engines serving one model this is (a Triton instance's index when
    # instance_group count > 1), as vLLM's data-parallel rank: it tags KV-event batches and
    # offsets their ports. Set by the backend, not by users.
    data_parallel_rank: int = 0
    # vLLM's VLLM_BATCH_INVARIANT as an argument: a request's tokens and logprobs do not
    # depend on the rest of the batch, its chunking or prefix hits (kernels/dispatch/
    # picks kernels whose reduction order is fixed per row). CPU only.
    batch_invariant: bool = False
    # vLLM's model_impl: "auto" runs a native implementation where one exists, else
    # transformers' own modeling code over the paged cache; "native" / "transformers"
    # insist on one (engine/models/registry.py).
    model_impl: str = "auto"
    # vLLM's disable_sliding_window: windowed layers attend to the whole context, and
    # max_model_len is capped at the window (engine/config/sliding_window.py).
    disable_sliding_window: bool = False
    # vLLM's generation_config: where a request's absent sampling keys get their values.
    # "auto": the model's generation_config.json; "vllm": SamplingParams' own defaults; a
    # folder: its generation_config.json (engine/config/generation.py).
    generation_config: str = "auto"
    # vLLM's override_generation_config: generation_config.json keys merged over that
    # (with "vllm", alone), e.g. {"temperature": 0.5}; None: none.
    override_generation_config: dict | None = None
    # vLLM's runner: "generate" (tokens), "pooling" (one vector per prompt: embeddings,
    # a cross-encoder's scores; engine/pooling/) or "auto" (pooling for the encoders and
    # sentence-transformers folders, else generate; engine/config/runner.py).
    runner: str = "auto"
    # vLLM's convert: "embed" pools a causal LM's final hidden states; "auto" picks it
    # under runner "pooling" for a causal LM; "none" keeps the model as it is.
    convert: str = "auto"
    # vLLM <= 0.12's task, folded into runner/convert here ("embed", "score", ...).
    task: str | None = None
    # vLLM's speculative_config (engine/config/speculative.py): a mapping or its JSON
    # text, kept as a SpeculativeConfig; None: one token per request per step.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.runner, self.convert = check_runner_args(self.runner, self.convert, self.task)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        check_generation_config(self.generation_config)
        self.override_generation_config = parse_override("override_generation_config",
                                                         self.override_generation_config)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if not isinstance(self.trace_max_bytes, int) or self.trace_max_bytes < 1024:
            raise ValueError(f"trace_max_bytes must be an integer >= 1024, got {self.trace_max_bytes!r}")
        if not isinstance(self.data_parallel_rank, int) or self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be an integer >= 0, got {self.data_parallel_rank!r}")
        if isinstance(self.kv_events_config, KVEventsConfig) and self.kv_events_config.active:
            # Here, before the weights load: a rank whose KV-event ports clash with another
            # rank's fails at once, naming them (the backend sets the rank by replace()).
            self.kv_events_config.check_rank_ports(self.data_parallel_rank)
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"num_threads must be an integer >= 0, got {self.num_threads!r}")
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and self.quantization == "gguf":
            # The packed GGUF blocks are quantized along the rows the shards would cut.
            raise ValueError("quantization 'gguf' runs in one process only; it cannot be "
                             f"combined with tensor_parallel_size={self.tensor_parallel_size}")
        if self.batch_invariant:
            self._check_batch_invariant()
        self.speculative_config = SpeculativeConfig.from_value("speculative_config",
                                                               self.speculative_config)
        if self.speculative_config is not None:
            self.speculative_config.check_target(self.tensor_parallel_size)

    def _check_batch_invariant(self) -> None:
        # Tensor parallelism (an all-reduce in rank order) and LoRA (the native update's
        # row-by-row sums) keep a row's bits; the CUDA kernels have no invariant variants.
        if self.device.startswith("cuda"):
            raise ValueError("batch_invariant runs on the CPU only yet, got device "
                             f"{self.device!r}")

    @property
    def torch_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def from_dict(cls, args: Mapping[str, Any]) -> "EngineConfig":
        """Flat engine args (vLLM names) -> config. Values may be strings, as they
        are in config.pbtxt parameters; each is converted to the field's type and a
        bad name or value raises ValueError naming it."""
        sections = {"scheduler": SchedulerConfig, "cache": CacheConfig, "lora": LoRAConfig}
        owner: dict[str, tuple[str | None, dataclasses.Field]] = {}
        for f in dataclasses.fields(cls):
            if f.name in sections:
                for sub in dataclasses.fields(sections[f.name]):
                    owner[sub.name] = (f.name, sub)
            else:
                owner[f.name] = (None, f)
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, raw in args.items():
            if key not in owner:
                raise ValueError(f"unknown engine argument {key!r}")
            section, f = owner[key]
            if key == "kv_events_config":
                value = KVEventsConfig.from_value(f"engine argument {key!r}", raw)
            elif key == "override_generation_config":  # an object, or its JSON text
                value = parse_override(f"engine argument {key!r}", raw)
            elif key == "speculative_config":
                value = SpeculativeConfig.from_value(key, raw)
            else:
                value = convert(f"engine argument {key!r}", raw, str(f.type))
            (nested[section] if section else top)[key] = value
        try:
            return cls(scheduler=SchedulerConfig(**nested["scheduler"]),
                       cache=CacheConfig(**nested["cache"]), lora=LoRAConfig(**nested["lora"]),
                       **top)
        except TypeError as exc:  # pragma: no cover - guarded by the name check
            raise ValueError(str(exc)) from exc
