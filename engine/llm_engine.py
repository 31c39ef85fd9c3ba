"""LLMEngine: add requests, step, stream per-step deltas, abort. One runner per engine
(vLLM's `runner`): generation here, or pooling (embeddings, cross-encoder scores), whose
loop is engine/pooling/engine.py's PoolingEngine and which this class hands its calls.

Over 300 lines: the generation step loop and its failure handling, plus the few lines
that route each public call to the pooling runner when the engine serves one."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from engine.config import EngineConfig
from engine.config.generation import load_sampling_defaults
from engine.config.runner import resolve_runner
from engine.core.kv_cache.publisher import NullEventPublisher
from engine.core.request import RequestStatus
from engine.core.sched_output import SchedulerOutput
from engine.faults import FaultPlan
from engine.input_processor import InputProcessor
from engine.lora.request import LoRARequest
from engine.metrics.trace import NullTrace
from engine.models.model_files import resolve_model_dir
from engine.output.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.pooling.engine import PoolingEngine, PoolingStepFailed
from engine.pooling.outputs import PoolingRequestOutput
from engine.pooling.params import PoolingParams
from engine.sample.sampler import SamplingError
from engine.sampling_params import SamplingParams
from engine.spec_decode.metrics import SpecDecodingStats
from engine.startup import start_engine
from engine.structured_output.waitlist import GrammarWaitlist

logger = logging.getLogger(__name__)

# How long a step with nothing to run but compiling grammars waits for one before it
# returns, so its caller still looks for new requests and cancellations that often.
GRAMMAR_WAIT_S = 0.02


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
    # enable_lora only (SchedulerStats' fields): adapter name -> running / waiting requests.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # policy="fair" only (SchedulerStats' fields): per tenant, waiting requests and tokens
    # computed since start.
    tenant_waiting: dict[str, int] = field(default_factory=dict)
    tenant_tokens_served: dict[str, int] = field(default_factory=dict)
    kv_events_dropped_total: int = 0  # KV-event batches the publisher's full queue refused
    # speculative_config only: the drafts' counters since start (vllm:spec_decode_*).
    spec_decoding: SpecDecodingStats | None = None


class EngineStepError(RuntimeError):
    """A step failed; the requests it was computing were aborted (listed here). `fatal`:
    no later step can succeed either (a tensor-parallel worker is gone). `bad_request`:
    the requests themselves were at fault (their grammar did not compile), not the engine."""

    def __init__(self, message: str, failed_request_ids: list[str], fatal: bool = False,
                 bad_request: bool = False) -> None:
        super().__init__(message)
        self.failed_request_ids = failed_request_ids
        self.fatal = fatal
        self.bad_request = bad_request


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, faults: FaultPlan | None = None,
                 **engine_args) -> None:
        if config is None:
            config = EngineConfig.from_dict(engine_args)
        elif engine_args:
            raise ValueError("pass either an EngineConfig or engine arguments, not both")
        self._tensor_parallel = self.kv_events = self.trace = None  # what close() stops
        # runner="pooling": the engine that does the work (None for generation).
        self.pooling: PoolingEngine | None = None
        choice = resolve_runner(config.runner, config.convert, resolve_model_dir(config.model))
        if choice.runner == "pooling":
            self._start_pooling(config, choice, faults)
            return
        # vLLM's generation_config: the sampling values a request's absent keys take, read
        # once; before the weights load, so a bad file fails at once (nothing to stop yet).
        self.sampling_defaults = load_sampling_defaults(
            config.generation_config, config.override_generation_config,
            resolve_model_dir(config.model))
        parts = start_engine(config, faults or FaultPlan())
        self.config = parts.config
        self.loaded = parts.loaded
        self.tokenizer = parts.loaded.tokenizer
        self.runner = parts.runner
        self.scheduler = parts.scheduler
        self.grammar_compiler = parts.grammar_compiler
        self.trace = parts.trace
        self.kv_events = parts.kv_events
        self._threads = parts.threads
        self._tensor_parallel = parts.tensor_parallel
        self.lora = parts.lora  # None unless enable_lora
        self.speculator = parts.speculator  # None unless speculative_config
        self.eos_token_ids = tuple(parts.loaded.eos_token_ids)
        # Owns what each request is handed and when (output kind, stream_interval).
        self.output_processor = OutputProcessor(self.config.scheduler.stream_interval)
        self._parallel = self.output_processor.parallel
        # Requests whose grammar is compiling, outside the scheduler until it is ready.
        self._grammar_waitlist = GrammarWaitlist()
        self.input_processor = InputProcessor(
            self.tokenizer, self.loaded.vocab_size, self.eos_token_ids,
            self.config.scheduler.max_model_len, self.config.max_logprobs, self.lora,
            self.grammar_compiler, is_taken=self.output_processor.__contains__,
            check_admissible=self.scheduler.check_new_request,
            sampling_defaults=self.sampling_defaults)
        self.prompt_tokens_total = 0
        # What the latest step computed, vLLM's iteration tokens: the prompt tokens it
        # scheduled plus the tokens it sampled (a decode's scheduled token is its sampled
        # one, a prefill's last chunk samples one more).
        self.last_step_num_tokens = 0

    def _start_pooling(self, config: EngineConfig, choice, faults: FaultPlan | None) -> None:
        """runner="pooling": the attributes callers read, from the pooling engine."""
        pooling = self.pooling = PoolingEngine(config, choice, faults)
        self.config, self.loaded, self.tokenizer = pooling.config, pooling.loaded, pooling.tokenizer
        self.scheduler, self.runner = pooling.scheduler, pooling.runner
        self.sampling_defaults = self.grammar_compiler = self.lora = None
        self.trace, self.kv_events = NullTrace(), NullEventPublisher()
        self._grammar_waitlist = GrammarWaitlist()  # stays empty
        self.eos_token_ids = tuple(pooling.loaded.eos_token_ids)
        self.last_step_num_tokens = 0  # prompt_tokens_total: the pooling engine counts

    @property
    def runner_type(self) -> str:
        """vLLM's: "generate" or "pooling", the one kind of request this engine serves."""
        return "generate" if self.pooling is None else "pooling"

    # ---- requests -----------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | tuple[str, str],
                    params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, tenant: str | None = None) -> None:
        """Raises ValueError naming what is wrong (engine/input_processor.py checks; for
        runner="pooling", engine/pooling/inputs.py's, and `prompt` may also be a
        (text, text_pair) tuple for a cross-encoder)."""
        if self.pooling is not None:
            if lora_request is not None or cache_salt is not None:
                raise ValueError("lora_request and cache_salt: not supported with "
                                 "runner='pooling'")
            return self.pooling.add_request(request_id, prompt, params, priority,
                                            arrival_time, tenant)
        if isinstance(params, PoolingParams):
            raise ValueError("PoolingParams: this engine runs runner='generate'; pooling "
                             "requests need an engine started with runner='pooling'")
        req = self.input_processor.process(request_id, prompt, params, priority, arrival_time,
                                           cache_salt, lora_request, tenant)
        # n > 1: added back to back, so the later children hit the first one's prompt blocks.
        # With a grammar compiling they wait beside the scheduler; others run meanwhile.
        if req.grammar is None:
            for request in req.sequences:
                self.scheduler.add_request(request)
        else:
            self._grammar_waitlist.add(request_id, req.grammar, req.sequences)
        self.output_processor.add_request(request_id, req.prompt_text, req.token_ids, req.params,
                                          req.sequences)
        # The prompt as received, once per request whatever n is.
        self.prompt_tokens_total += len(req.token_ids)

    def abort_request(self, request_ids: str | Iterable[str]
                      ) -> list[RequestOutput] | list[PoolingRequestOutput]:
        if self.pooling is not None:
            return self.pooling.abort_request(request_ids)
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        sequence_ids = self._parallel.sequence_ids(request_ids)
        aborted = self.scheduler.finish_requests(sequence_ids, RequestStatus.FINISHED_ABORTED)
        # A request whose grammar is compiling: dropped, its compile result never read.
        aborted += self._grammar_waitlist.abort(sequence_ids)
        for request in aborted:
            self.trace.finished(request, cancelled=True)
        if self.speculator is not None:
            self.speculator.finished(aborted)
        self._publish_kv_events()
        return self.output_processor.abort(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or len(self._grammar_waitlist) > 0

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests() + len(self._grammar_waitlist)

    # ---- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and return the outputs due: what the requests' output
        kinds and stream_interval let out of what they released, and every finished
        request (engine/output/output_processor.py). Raises EngineStepError naming the
        requests it aborted: those whose sampling failed on their own (the rest of the
        batch resamples next step), or, when the model failed, every request of the step.
        The engine is then ready for the next step. runner="pooling": the
        PoolingRequestOutputs of the requests whose prompt the step completed."""
        if self.pooling is not None:
            return self._pooling_step()
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _pooling_step(self) -> list[PoolingRequestOutput]:
        try:
            return self.pooling.step()
        except PoolingStepFailed as exc:
            raise EngineStepError(str(exc), exc.failed_request_ids) from exc.__cause__
        finally:
            self.last_step_num_tokens = self.pooling.last_step_num_tokens

    def _step(self) -> list[RequestOutput]:
        self._admit_compiled()
        trace = self.trace
        trace.step_started(self.scheduler.num_preemptions_total)
        sched_out = self.scheduler.schedule()
        self.last_step_num_tokens = 0
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
        trace.step_scheduled(sched_out)
        updated = self.scheduler.update_from_output(sched_out, result.sampled_token_ids)
        self.last_step_num_tokens = sched_out.total_num_scheduled_tokens + sum(
            1 for request in updated if request.num_output_tokens == 1)
        if self.speculator is not None:
            self.speculator.finished(updated)
            self.speculator.propose(updated, len(self.scheduler.running))
        trace.requests_updated(updated)
        outputs = self.output_processor.process(updated, result.logprobs, result.prompt_logprobs)
        trace.step_ended(self.scheduler.num_preemptions_total)  # its time includes the outputs
        return outputs

    def _admit_compiled(self) -> None:
        """Hands the sequences whose grammar is ready to the scheduler. With nothing else
        to run, waits a little for a compile first rather than return an empty step at
        once (the caller would spin). A compile that failed after its spec passed the
        check fails its request alone, before this step schedules anything."""
        waitlist = self._grammar_waitlist
        if not len(waitlist):
            return
        if not self.scheduler.has_unfinished_requests():
            waitlist.wait(GRAMMAR_WAIT_S)
        ready, failed = waitlist.take_done()
        for request in ready:
            self.scheduler.add_request(request)
        if not failed:
            return
        sequence_ids = [r.request_id for f in failed for r in f.sequences]
        client_ids = self._parallel.client_ids(sequence_ids)
        for failure in failed:
            logger.error("compiling the grammar of request %s failed", failure.request_id,
                         exc_info=failure.error)
            for request in failure.sequences:
                request.status = RequestStatus.FINISHED_ABORTED
        self.output_processor.forget(sequence_ids)
        raise EngineStepError("grammar compile failed: " + "; ".join(
            f"{f.request_id}: {f.error}" for f in failed), client_ids, bad_request=True)

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
        fatal = self._tensor_parallel is not None and self._tensor_parallel.failure is not None
        return EngineStepError(f"model execution failed: {exc}", client_ids, fatal=fatal)

    def _abort_failed(self, request_ids: list[str]) -> None:
        failed = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request in failed:
            self.trace.finished(request)
        if self.speculator is not None:
            self.speculator.finished(failed)
        self.output_processor.forget(request_ids)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(num_running=s.num_running,
                           num_waiting=s.num_waiting + len(self._grammar_waitlist),
                           kv_cache_usage=s.kv_cache_usage,
                           prefix_cache_queries=s.prefix_cache_queries,
                           prefix_cache_hits=s.prefix_cache_hits,
                           num_preemptions_total=s.num_preemptions_total,
                           prompt_tokens_total=self.prompt_tokens_total if self.pooling is None
                           else self.pooling.prompt_tokens_total,
                           generation_tokens_total=s.generation_tokens_total,
                           running_lora_adapters=s.running_lora_adapters,
                           waiting_lora_adapters=s.waiting_lora_adapters,
                           tenant_waiting=s.tenant_waiting,
                           tenant_tokens_served=s.tenant_tokens_served,
                           kv_events_dropped_total=self.kv_events.dropped,
                           spec_decoding=None if s.spec_decoding is None
                           else s.spec_decoding.snapshot())

    def reset_prefix_cache(self) -> None:
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        self.kv_events.publish(self.scheduler.kv_cache_manager.take_events())

    def close(self) -> None:
        """Release what outlives a step: the tensor-parallel workers (also stopped at
        interpreter exit), the KV-event sockets (their ports) and the trace. Safe to call
        twice; a constructor that fails half-way has stopped them already. The grammar
        compiler's thread and xgrammar's state go too, while the interpreter is whole."""
        if getattr(self, "grammar_compiler", None) is not None:
            self.grammar_compiler.close()
        if self._tensor_parallel is not None:
            self._tensor_parallel.close()
        if self.kv_events is not None:
            self.kv_events.shutdown()
            self.kv_events = NullEventPublisher()
        if self.trace is not None:
            self.trace.close()
            self.trace = NullTrace()
