"""Engine configuration: one object, validated once, handed down to every layer."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.core.kv_cache.hashing import HASH_ALGOS
from engine.core.kv_cache.publisher import KVEventsConfig
from engine.values import convert

POLICIES = ("fcfs", "priority")
DTYPES = ("bfloat16", "float32", "float16", "auto")
QUANTIZATIONS = (None, "gguf")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # None: the model's max_position_embeddings (resolved by the engine).
    max_model_len: int | None = None
    # 0 disables the per-request chunk cap; otherwise each request gets at most
    # this many tokens per step so long prompts cannot starve decodes.
    long_prefill_token_threshold: int = 0
    # vLLM V0's limits on prefills in one step (engine/core/partial_prefills.py); 0: no limit.
    # max_long_partial_prefills 0 means max_num_partial_prefills.
    max_num_partial_prefills: int = 0
    max_long_partial_prefills: int = 0
    # A request readmitted after k preemptions is not the preemption victim for the next
    # k steps while another can be (engine/core/scheduler.py _pick_victim): against a request
    # evicted at every chunk of its recompute, at some cost in recomputed tokens.
    shield_resumed: bool = False
    policy: str = "fcfs"
    # vLLM's name: a streamed request (RequestOutputKind DELTA / CUMULATIVE) gets its first
    # output at once, then one per this many released tokens, and the final one; the held
    # deltas are merged (engine/output/output_processor.py). More means fewer responses.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, "
                             f"got {self.long_prefill_token_threshold}")
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_long_partial_prefills and not self.max_num_partial_prefills:
            raise ValueError("max_long_partial_prefills needs max_num_partial_prefills")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) "
                             f"must be <= max_num_partial_prefills "
                             f"({self.max_num_partial_prefills})")
        _positive("stream_interval", self.stream_interval)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # None: derived from kv_cache_memory_bytes once the model shape is known.
    num_kv_blocks: int | None = None
    # None: 2 GiB on a CPU; on a GPU what gpu_memory_utilization leaves once the weights
    # and a profiled forward are in (engine/worker/kv_pool.py sizes the pool).
    kv_cache_memory_bytes: int | None = None
    # vLLM's meaning: the share of the GPU's memory this engine may use in all (weights,
    # activations, KV pool). None: 0.9. Ignored on a CPU, as vLLM's CPU backend does.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # vLLM's name. "builtin" (Python's hash(), the fast default) or, for block hashes an
    # outside indexer can recompute from tokens, "sha256" / "sha256_cbor"
    # (engine/core/kv_cache/hashing.py).
    prefix_caching_hash_algo: str = "builtin"
    # Fraction of all blocks kept free when admitting new or resumed requests.
    watermark: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}")

    @property
    def explicit_pool(self) -> bool:
        return self.num_kv_blocks is not None or self.kv_cache_memory_bytes is not None

    @property
    def watermark_blocks(self) -> int:
        assert self.num_kv_blocks is not None
        return int(self.watermark * self.num_kv_blocks)


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
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if not isinstance(self.trace_max_bytes, int) or self.trace_max_bytes < 1024:
            raise ValueError(f"trace_max_bytes must be an integer >= 1024, got {self.trace_max_bytes!r}")
        if not isinstance(self.data_parallel_rank, int) or self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be an integer >= 0, got {self.data_parallel_rank!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"num_threads must be an integer >= 0, got {self.num_threads!r}")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and self.quantization == "gguf":
            # The packed GGUF blocks are quantized along the rows the shards would cut.
            raise ValueError("quantization 'gguf' runs in one process only; it cannot be "
                             f"combined with tensor_parallel_size={self.tensor_parallel_size}")

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
        sections = {"scheduler": SchedulerConfig, "cache": CacheConfig}
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
            else:
                value = convert(f"engine argument {key!r}", raw, str(f.type))
            (nested[section] if section else top)[key] = value
        try:
            return cls(scheduler=SchedulerConfig(**nested["scheduler"]),
                       cache=CacheConfig(**nested["cache"]), **top)
        except TypeError as exc:  # pragma: no cover - guarded by the name check
            raise ValueError(str(exc)) from exc


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
