"""What LLMEngine is made of, built in order: CPU threads, the model (split over the
tensor-parallel ranks), the KV pool's size, the runner and the scheduler, warm-up and
CUDA graphs, the grammar compiler, the trace and the KV-event publisher. A failure half-way
stops whatever had started (the workers, the event sockets)."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.kv_cache.publisher import NullEventPublisher, ZmqEventPublisher, make_publisher
from engine.core.scheduler import Scheduler
from engine.faults import FaultPlan
from engine.metrics.trace import NullTrace, TraceRecorder, speculative_args
from engine.models import load_model
from engine.models.moe import ExpertLoad
from engine.spec_decode.draft_model import draft_block_bytes, load_draft
from engine.spec_decode.proposer import make_proposer
from engine.spec_decode.speculator import Speculator
from engine.structured_output.grammar import GrammarCompiler
from engine.worker.cpu_threads import ThreadGovernor, configure_threads
from engine.worker.kv_pool import kv_layout, resolve_kv_pool
from engine.worker.model_runner import ModelRunner
from kernels.dispatch import detect_cpu

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    config: EngineConfig  # resolved: max_model_len and num_kv_blocks filled in
    loaded: Any           # engine.models.loader.LoadedModel (rank 0's shard under TP)
    runner: ModelRunner
    scheduler: Scheduler
    grammar_compiler: GrammarCompiler
    trace: TraceRecorder | NullTrace
    kv_events: ZmqEventPublisher | NullEventPublisher
    threads: ThreadGovernor | None
    tensor_parallel: Any  # engine.distributed.executor.TensorParallelExecutor or None
    lora: Any = None  # engine.lora.runtime.LoRARuntime when enable_lora
    # engine.spec_decode.speculator.Speculator when speculative_config is set
    speculator: Any = None


def _check_model_supports(config: EngineConfig, loaded) -> None:
    """Features a model class declares it lacks (supports_* class attributes, True when
    absent) are refused here, naming the architecture, not deep inside their set-up."""
    arch = (getattr(loaded.hf_config, "architectures", None) or ["?"])[0]
    impl = type(loaded.model).__name__
    tp_size = config.tensor_parallel_size
    if tp_size > 1 and not getattr(loaded.model, "supports_tensor_parallel", True):
        raise ValueError(f"tensor_parallel_size={tp_size}: {arch} runs as {impl}, which has "
                         "no tensor parallelism; use tensor_parallel_size 1")
    if config.lora.enable_lora and not getattr(loaded.model, "supports_lora", True):
        raise ValueError(f"enable_lora: {arch} runs as {impl}, which takes no LoRA adapters")


def start_engine(config: EngineConfig, faults: FaultPlan) -> EngineParts:
    tp_size = config.tensor_parallel_size
    num_cpus = detect_cpu().num_cpus
    # Ranks share the CPUs: each gets its part, fixed (the governor would count the
    # other ranks as busy neighbours and shrink every rank to one thread).
    num_threads = (config.num_threads or max(1, num_cpus // tp_size)) if tp_size > 1 \
        else config.num_threads
    threads = configure_threads(num_threads, num_cpus, config.torch_device)
    if config.batch_invariant and config.torch_device != "cpu":
        raise ValueError("batch_invariant runs on the CPU only yet; this engine would run on "
                         f"{config.torch_device} (set device: cpu)")
    loaded = load_model(config.model, config.dtype, tokenizer=config.tokenizer,
                        device=config.torch_device, quantization=config.quantization,
                        batch_invariant=config.batch_invariant, model_impl=config.model_impl,
                        disable_sliding_window=config.disable_sliding_window)
    _check_model_supports(config, loaded)
    tensor_parallel = kv_events = None
    try:  # from here a failure must also stop the workers and close the sockets
        if tp_size > 1:
            # After this rank's load, so a model that cannot be split fails before any starts.
            from engine.distributed.executor import TensorParallelExecutor
            tensor_parallel = TensorParallelExecutor(config, loaded.hf_config,
                                                     str(loaded.model_dir), num_threads)
            loaded = tensor_parallel.shard(loaded)
        # The KV-cache groups (sliding-window layers apart): the scheduler allocates for
        # them, the runner lays its tensors out by them, the pool is sized by them.
        layout = kv_layout(loaded)
        if layout.has_window or layout.num_groups > 1:
            logger.info("KV cache: %d group(s) of %d layer(s), windows %s", layout.num_groups,
                        layout.group_size, list(layout.windows))
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = _load_draft(config, loaded, layout)
        config = resolve_kv_pool(
            config, loaded, layout,
            draft_block_bytes=0 if draft is None else draft_block_bytes(draft,
                                                                       config.cache.block_size))
        sched_cfg, cache_cfg = config.scheduler, config.cache
        send_step = None
        if tensor_parallel is not None:
            from engine.distributed.worker import CacheSetup
            tensor_parallel.start(CacheSetup(cache_cfg.num_kv_blocks, cache_cfg.block_size,
                                             sched_cfg.max_num_batched_tokens,
                                             sched_cfg.max_model_len,
                                             sched_cfg.max_num_seqs,
                                             layer_windows=layout.layer_windows))
            send_step = tensor_parallel.send_step
        lora = None
        if config.lora.enable_lora and tensor_parallel is not None:
            from engine.distributed.worker import lora_runtime
            lora = lora_runtime(loaded, config.lora, tensor_parallel.group)
        elif config.lora.enable_lora:
            from engine.lora.runtime import LoRARuntime
            lora = LoRARuntime(loaded.model, config.lora, loaded.dtype,
                               next(loaded.model.parameters()).device)
        runner = ModelRunner(loaded, cache_cfg.num_kv_blocks, cache_cfg.block_size,
                             seed=config.seed, faults=faults, send_step=send_step, lora=lora,
                             batch_invariant=config.batch_invariant, layout=layout)
        kv_events = make_publisher(config.kv_events_config, config.data_parallel_rank)
        if kv_events.enabled and cache_cfg.prefix_caching_hash_algo == "builtin":
            logger.warning("KV-cache events are on with prefix_caching_hash_algo=builtin: an "
                           "indexer cannot recompute these keys from tokens; use sha256_cbor")
        scheduler = Scheduler(sched_cfg, cache_cfg, enable_kv_events=kv_events.enabled,
                              lora_config=config.lora, kv_layout=layout,
                              num_spec_tokens=spec.num_speculative_tokens if spec else 0,
                              num_lookahead_tokens=0 if draft is None
                              else spec.num_speculative_tokens)
        speculator = None
        if spec is not None:
            tables = scheduler.kv_cache_manager.req_to_block_ids
            proposer = make_proposer(spec, draft=draft, num_kv_blocks=cache_cfg.num_kv_blocks,
                                     block_size=cache_cfg.block_size, seed=config.seed,
                                     block_table=lambda request_id: tables[request_id][0])
            speculator = Speculator(spec, proposer, sched_cfg.max_model_len)
            runner.num_spec_tokens = spec.num_speculative_tokens
        warm_start = time.perf_counter()
        runner.warm_up(sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs,
                       sched_cfg.max_model_len)
        # CUDA graphs replay one rank's kernels; the all-reduces between them are not
        # captured here, so tensor-parallel decode steps run eagerly; nor are the LoRA
        # groups, which change shape every step.
        if (runner.device.type == "cuda" and not config.enforce_eager and tp_size == 1
                and lora is None):
            runner.use_decode_graphs(sched_cfg.max_num_seqs, sched_cfg.max_model_len,
                                     capture=True)
        warm_up_s = time.perf_counter() - warm_start
        # Load and warm-up span a long window: a busy neighbour is seen before the first step.
        if threads is not None:
            threads.adapt()
        # Also called by the backend on Triton's execute thread (see GrammarCompiler).
        grammar_compiler = GrammarCompiler(loaded.tokenizer, loaded.vocab_size,
                                           tuple(loaded.eos_token_ids))
        trace = open_trace(config, loaded, layout)
    except BaseException:
        if tensor_parallel is not None:
            tensor_parallel.close()
        if kv_events is not None:
            kv_events.shutdown()
        raise
    logger.info("engine ready: model %s (%s), %d KV blocks x %d tokens, max_model_len %d; "
                "CPU %s; load %.1f s, warm-up %.1f s", loaded.model_dir,
                str(loaded.dtype).removeprefix("torch."), cache_cfg.num_kv_blocks,
                cache_cfg.block_size, sched_cfg.max_model_len, detect_cpu().describe(),
                loaded.load_seconds, warm_up_s)
    return EngineParts(config, loaded, runner, scheduler, grammar_compiler, trace, kv_events,
                       threads, tensor_parallel, lora, speculator)


def _load_draft(config: EngineConfig, loaded, layout):
    """speculative_config's draft model: its K/V shares the target's blocks, which needs
    one full-attention KV-cache group."""
    if layout.num_groups > 1 or layout.has_window:
        raise ValueError("speculative_config method 'draft_model': the target has "
                         "sliding-window layers, whose blocks a draft cannot share yet")
    max_model_len = config.scheduler.max_model_len or loaded.max_position_embeddings
    return load_draft(config.speculative_config, loaded, max_model_len,
                      batch_invariant=config.batch_invariant)


def open_trace(config: EngineConfig, loaded, layout) -> TraceRecorder | NullTrace:
    """`layout`: the KV-cache groups the scheduler runs (their windows go in the header, so
    tuning/replay.py replays the same groups and sizes blocks as the engine does)."""
    if config.trace_path is None:
        return NullTrace()
    sched, cache = config.scheduler, config.cache
    args = {**dataclasses.asdict(sched), **dataclasses.asdict(cache), "dtype": config.dtype,
            "quantization": config.quantization,
            # where each expert's tokens were computed (the steps' expert_tokens)
            "tensor_parallel_size": config.tensor_parallel_size,
            "enable_expert_parallel": config.enable_expert_parallel,
            "speculative_config": speculative_args(config.speculative_config)}
    header = {"block_size": cache.block_size, "model": str(loaded.model_dir),
              "kv_bytes_per_token": loaded.kv_cache_bytes_per_token(),
              "kv_layer_windows": list(layout.layer_windows),
              "dtype": str(loaded.dtype).removeprefix("torch."),
              "host": detect_cpu().describe(), "engine_args": args}
    try:
        recorder = TraceRecorder(config.trace_path, config.trace_max_bytes, header)
    except OSError as exc:
        logger.error("workload trace %s: %s; tracing switched off, requests are unaffected",
                     config.trace_path, exc)
        return NullTrace()
    # Only now, with a trace to write them to, do the MoE blocks start counting.
    recorder.expert_load = ExpertLoad.of(loaded.model)
    logger.info("recording a workload trace to %s", config.trace_path)
    return recorder
