"""LLMEngine: add requests, step, stream per-step deltas, abort."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Iterable


from engine.config import CPU_KV_CACHE_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from engine.worker.cpu_threads import configure_threads
from engine.output.detokenizer import IncrementalDetokenizer
from engine.core.kv_cache.publisher import make_publisher
from engine.worker.model_runner import ModelRunner
from engine.models import load_model
from engine.output.output_processor import OutputProcessor
from engine.output.parallel_sampling import fan_out
from engine.core.request import Request, RequestStatus
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sample.sampler import SamplingError
from engine.structured_output.grammar import GrammarCompiler, RequestGrammar
from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.metrics.trace import TraceRecorder, step_features
from kernels.cpu import features as cpu_features

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int


class EngineStepError(RuntimeError):
    """A step failed; the requests it was computing were aborted (listed here)."""

    def __init__(self, message: str, failed_request_ids: list[str]) -> None:
        super().__init__(message)
        self.failed_request_ids = failed_request_ids


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **engine_args) -> None:
        if config is None:
            config = EngineConfig.from_dict(engine_args)
        elif engine_args:
            raise ValueError("pass either an EngineConfig or engine arguments, not both")
        tp_size = config.tensor_parallel_size
        num_cpus = cpu_features.detect().num_cpus
        # Ranks share the CPUs: each gets its part, fixed (the governor would count the
        # other ranks as busy neighbours and shrink every rank to one thread).
        num_threads = (config.num_threads or max(1, num_cpus // tp_size)) if tp_size > 1 \
            else config.num_threads
        self._threads = configure_threads(num_threads, num_cpus, config.torch_device)
        loaded = load_model(config.model, config.dtype, tokenizer=config.tokenizer,
                            device=config.torch_device, quantization=config.quantization)
        self._tensor_parallel = None
        if tp_size > 1:
            loaded = self._start_tensor_parallel(config, loaded, num_threads)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        try:  # from here a failure must also stop the tensor-parallel workers
            self.config = self._resolve(config, loaded)
            sched_cfg, cache_cfg = self.config.scheduler, self.config.cache
            send_step = None
            if self._tensor_parallel is not None:
                from engine.distributed.worker import CacheSetup
                self._tensor_parallel.start(CacheSetup(
                    cache_cfg.num_kv_blocks, cache_cfg.block_size,
                    sched_cfg.max_num_batched_tokens, sched_cfg.max_model_len))
                send_step = self._tensor_parallel.send_step
            self.runner = ModelRunner(loaded, cache_cfg.num_kv_blocks, cache_cfg.block_size,
                                      seed=self.config.seed,
                                      inject_failure_at_step=self.config.inject_failure_at_step,
                                      send_step=send_step)
            self.kv_events = make_publisher(self.config.kv_events_config,
                                            self.config.data_parallel_rank)
            self.scheduler = Scheduler(sched_cfg, cache_cfg,
                                       enable_kv_events=self.kv_events is not None)
            warm_start = time.perf_counter()
            self.runner.warm_up(sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs,
                                sched_cfg.max_model_len)
        except BaseException:
            self.close()
            raise
        # CUDA graphs replay one rank's kernels; the all-reduces between them are not
        # captured here, so tensor-parallel decode steps run eagerly.
        if (self.runner.device.type == "cuda" and not self.config.enforce_eager
                and tp_size == 1):
            self.runner.use_decode_graphs(sched_cfg.max_num_seqs, sched_cfg.max_model_len,
                                          capture=True)
        warm_up_s = time.perf_counter() - warm_start
        # Load and warm-up span a long window: a busy neighbour is seen before the first step.
        if self._threads is not None:
            self._threads.adapt()
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        # Also called by the backend on Triton's execute thread (see GrammarCompiler).
        self.grammar_compiler = GrammarCompiler(self.tokenizer, loaded.vocab_size,
                                                self.eos_token_ids)
        # Owns what each request is handed and when (output kind, stream_interval).
        self.output_processor = OutputProcessor(sched_cfg.stream_interval)
        self._parallel = self.output_processor.parallel
        self.trace = self._open_trace(self.config, loaded)
        if self.kv_events is not None and cache_cfg.prefix_caching_hash_algo == "builtin":
            logger.warning("KV-cache events are on with prefix_caching_hash_algo=builtin: an "
                           "indexer cannot recompute these keys from tokens; use sha256_cbor")
        self.prompt_tokens_total = 0
        logger.info("engine ready: model %s (%s), %d KV blocks x %d tokens, max_model_len %d; "
                    "CPU %s; load %.1f s, warm-up %.1f s", loaded.model_dir,
                    str(loaded.dtype).removeprefix("torch."), cache_cfg.num_kv_blocks,
                    cache_cfg.block_size, sched_cfg.max_model_len, cpu_features.detect().describe(),
                    loaded.load_seconds, warm_up_s)

    def _start_tensor_parallel(self, config: EngineConfig, loaded, num_threads: int):
        """Spawn the workers (after this rank's load, so a model that cannot be split
        fails before any starts) and return rank 0's shard of `loaded`."""
        from engine.distributed.executor import TensorParallelExecutor
        self._tensor_parallel = TensorParallelExecutor(config, loaded.hf_config,
                                                       str(loaded.model_dir), num_threads)
        try:
            return self._tensor_parallel.shard(loaded)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _resolve(config: EngineConfig, loaded) -> EngineConfig:
        """Fill in what depends on the model and refuse configurations that cannot
        serve one request of max_model_len."""
        sched = config.scheduler
        cache = config.cache
        max_model_len = sched.max_model_len or loaded.max_position_embeddings
        if max_model_len > loaded.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({loaded.max_position_embeddings})")
        num_blocks = cache.num_kv_blocks
        if num_blocks is None:
            per_block = loaded.kv_cache_bytes_per_token() * cache.block_size
            num_blocks = LLMEngine._pool_bytes(config, loaded) // per_block
        needed = -(-max_model_len // cache.block_size)
        usable = num_blocks - int(cache.watermark * num_blocks)
        if usable < needed:
            raise ValueError(
                f"KV cache too small: {num_blocks} blocks of {cache.block_size} tokens "
                f"(watermark {cache.watermark}) cannot hold one request of max_model_len="
                f"{max_model_len} ({needed} blocks); raise num_kv_blocks / "
                f"kv_cache_memory_bytes or lower max_model_len")
        return dataclasses.replace(
            config,
            scheduler=dataclasses.replace(sched, max_model_len=max_model_len),
            cache=dataclasses.replace(cache, num_kv_blocks=num_blocks))

    @staticmethod
    def _open_trace(config: EngineConfig, loaded) -> TraceRecorder | None:
        if config.trace_path is None:
            return None
        sched, cache = config.scheduler, config.cache
        args = {**dataclasses.asdict(sched), **dataclasses.asdict(cache), "dtype": config.dtype,
                "quantization": config.quantization}
        header = {"block_size": cache.block_size, "model": str(loaded.model_dir),
                  "kv_bytes_per_token": loaded.kv_cache_bytes_per_token(),
                  "dtype": str(loaded.dtype).removeprefix("torch."),
                  "host": cpu_features.detect().describe(), "engine_args": args}
        logger.info("recording a workload trace to %s", config.trace_path)
        return TraceRecorder(config.trace_path, config.trace_max_bytes, header)

    @staticmethod
    def _pool_bytes(config: EngineConfig, loaded) -> int:
        cache, device = config.cache, config.torch_device
        if cache.gpu_memory_utilization is not None and (cache.explicit_pool
                                                         or not device.startswith("cuda")):
            why = "the KV pool's size is given" if cache.explicit_pool else (
                f"on {device}, as vLLM's CPU backend ignores it")
            logger.info("gpu_memory_utilization ignored: %s", why)
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if not device.startswith("cuda"):
            return CPU_KV_CACHE_BYTES
        from engine.worker.gpu_memory import profile_kv_pool_bytes
        share = cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        sched = config.scheduler
        pool = profile_kv_pool_bytes(loaded, share, sched.max_num_batched_tokens,
                                     sched.max_num_seqs, cache.block_size)
        logger.info("KV pool %.2f GiB: gpu_memory_utilization %s of %s after the weights "
                    "and a profiled %d-token step", pool / 1024**3, share, device,
                    sched.max_num_batched_tokens)
        return pool

    # ---- requests -----------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        params = params or SamplingParams()
        sequences = fan_out(request_id, params)
        for rid in {request_id, *(rid for rid, _ in sequences)}:
            if rid in self.output_processor:
                raise ValueError(f"request id {rid!r} is already in use")
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        # Length first: a huge id list is refused before it is scanned (on the engine thread).
        max_model_len = self.config.scheduler.max_model_len
        if len(token_ids) >= max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, which does not leave room "
                             f"for output within max_model_len={max_model_len}")
        vocab = self.loaded.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:5]}")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"SamplingParams.logprobs must be <= max_logprobs "
                             f"({self.config.max_logprobs}), got {params.logprobs}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be < vocab size {vocab}")
        if any(t >= vocab for q in params.stop_token_sequences for t in q):
            raise ValueError(f"SamplingParams.stop_token_sequences must be < vocab size {vocab}")
        # Before any sequence exists, so an invalid spec adds nothing; a cache hit when
        # the backend compiled it already.
        compiled_grammar = (None if params.structured_outputs is None
                            else self.grammar_compiler.compile(params.structured_outputs))
        # n > 1: added back to back, so the later children hit the first one's prompt blocks.
        requests = []
        for rid, seq_params in sequences:
            request = Request(rid, token_ids, seq_params, priority=priority,
                              arrival_time=arrival_time, eos_token_id=self.eos_token_ids,
                              cache_salt=cache_salt, detokenizer=IncrementalDetokenizer(
                                  self.tokenizer, token_ids, seq_params))
            if compiled_grammar is not None:
                request.grammar = RequestGrammar.start(compiled_grammar)
            if params.max_tokens is None:
                request.max_tokens = max_model_len - len(token_ids)
            self.scheduler.add_request(request)
            requests.append(request)
        self.output_processor.add_request(request_id, prompt_text, token_ids, params, requests)
        # The prompt as received, once per request whatever n is.
        self.prompt_tokens_total += len(token_ids)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = self.scheduler.finish_requests(self._parallel.sequence_ids(request_ids),
                                                 RequestStatus.FINISHED_ABORTED)
        if self.trace is not None:
            for request in aborted:
                self.trace.finished(request, cancelled=True)
        self._publish_kv_events()
        return self.output_processor.abort(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and return the outputs due: what the requests' output
        kinds and stream_interval let out of what they released, and every finished
        request (engine/output/output_processor.py). Raises EngineStepError naming the
        requests it aborted: those whose sampling failed on their own (the rest of the
        batch resamples next step), or, when the model failed, every request of the step.
        The engine is then ready for the next step."""
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _step(self) -> list[RequestOutput]:
        trace = self.trace
        if trace is not None:
            step_start = trace.now()
            preemptions = self.scheduler.num_preemptions_total
        sched_out = self.scheduler.schedule()
        if not sched_out.scheduled_requests:
            if sched_out.finished_req_ids:
                self.runner.execute(sched_out)  # only frees the runner's state for them
            return []
        if self._threads is not None:
            self._threads.adapt()
        try:
            result = self.runner.execute(sched_out)
        except Exception as exc:
            if self._tensor_parallel is not None:
                exc = self._tensor_parallel.explain(exc)
            raise self._fail_step(sched_out, exc) from exc
        if trace is not None:
            features = step_features(sched_out)
        updated = self.scheduler.update_from_output(sched_out, result.sampled_token_ids)
        if trace is not None:
            for request in updated:
                trace.first_token(request)
                if request.is_finished:
                    trace.finished(request)
        outputs = self.output_processor.process(updated, result.logprobs)
        if trace is not None:  # the step's time includes building its outputs
            trace.step(features, step_start, trace.now() - step_start,
                       self.scheduler.num_preemptions_total - preemptions)
        return outputs

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> EngineStepError:
        """Abort whom the failure is attributable to and return the error to raise."""
        scheduled = sched_out.scheduled_requests
        culprits = set(exc.failed_request_ids) if isinstance(exc, SamplingError) else set()
        # A failed sequence fails its whole request: siblings go too, reported by parent id.
        failed = self._parallel.sequence_ids(r.request_id for r in scheduled
                                             if r.request_id in culprits)
        client_ids = self._parallel.client_ids(failed)
        if failed:
            # The forward ran to the end, so every K/V of the step is written; only these
            # rows' sampling is broken. The others resample next step.
            logger.error("sampling failed for %s; aborting them, %d other request(s) of the "
                         "step carry on", failed, len(scheduled) - len(failed), exc_info=exc)
            self._abort_failed(failed)
            self.scheduler.retry_sampling(scheduled)
            return EngineStepError(f"sampling failed for request(s) {client_ids}: {exc}",
                                   client_ids)
        failed = self._parallel.sequence_ids(r.request_id for r in scheduled)
        client_ids = self._parallel.client_ids(failed)
        logger.exception("engine step failed; aborting %d requests", len(failed))
        self._abort_failed(failed)
        # Blocks registered at allocation may never have been written.
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        return EngineStepError(f"model execution failed: {exc}", client_ids)

    def _abort_failed(self, request_ids: list[str]) -> None:
        failed = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.trace is not None:
            for request in failed:
                self.trace.finished(request)
        self.output_processor.forget(request_ids)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting,
                           kv_cache_usage=s.kv_cache_usage,
                           prefix_cache_queries=s.prefix_cache_queries,
                           prefix_cache_hits=s.prefix_cache_hits,
                           num_preemptions_total=s.num_preemptions_total,
                           prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=s.generation_tokens_total)

    def reset_prefix_cache(self) -> None:
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv_cache_manager.take_events())

    def close(self) -> None:
        """Release what outlives a step: the tensor-parallel workers (also stopped at
        interpreter exit), the KV-event sockets (their ports) and the trace. Safe to call
        twice, and from a constructor that failed half-way."""
        if getattr(self, "_tensor_parallel", None) is not None:
            self._tensor_parallel.close()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.shutdown()
            self.kv_events = None
        if getattr(self, "trace", None) is not None:
            self.trace.close()
            self.trace = None
