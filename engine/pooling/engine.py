"""The pooling runner's engine loop (LLMEngine serves it when runner="pooling"): add a
pooling request, step, abort. A request goes through the scheduler like a generation
request (token budget, seats, chunked prefill, prefix hits, preemption, the queue
policy) and finishes in the step that computes its prompt's last chunk, returning one
PoolingRequestOutput; its KV blocks are freed then."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

from engine.config import EngineConfig
from engine.config.runner import RunnerChoice
from engine.core.fair_share import check_tenant
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import SchedulerStats
from engine.faults import FaultPlan
from engine.pooling.inputs import PoolingInputs, PoolingPrompt
from engine.pooling.outputs import PoolingOutput, PoolingRequestOutput
from engine.pooling.params import PoolingParams
from engine.pooling.startup import start_pooling_engine

logger = logging.getLogger(__name__)


class PoolingStepFailed(RuntimeError):
    """The step's forward failed; its requests were aborted (listed here)."""

    def __init__(self, message: str, failed_request_ids: list[str]) -> None:
        super().__init__(message)
        self.failed_request_ids = failed_request_ids


@dataclass(slots=True)
class _Pending:
    params: PoolingParams
    segment_start: int | None  # a pair's second segment (token type 1) starts here


class PoolingEngine:
    def __init__(self, config: EngineConfig, choice: RunnerChoice,
                 faults: FaultPlan | None = None) -> None:
        parts = start_pooling_engine(config, choice, faults or FaultPlan())
        self.config = parts.config
        self.loaded = parts.loaded
        self.tokenizer = parts.loaded.tokenizer
        self.settings = parts.settings
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self._threads = parts.threads
        self.inputs = PoolingInputs(self.tokenizer, self.loaded.vocab_size,
                                    self.config.scheduler.max_model_len, self.settings,
                                    self.loaded.hidden_size)
        self._pending: dict[str, _Pending] = {}
        self.prompt_tokens_total = 0
        self.last_step_num_tokens = 0

    @property
    def task(self) -> str:
        """"embed" (an embedding per prompt) or "classify" (a classifier's scores)."""
        return self.settings.task

    def add_request(self, request_id: str, prompt: PoolingPrompt,
                    params: PoolingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, tenant: str | None = None) -> None:
        """`prompt`: a text, token ids, or (text, text_pair) for a cross-encoder. Raises
        ValueError naming what is wrong; nothing is kept then."""
        params = self.inputs.check_params(params)
        check_tenant(tenant)
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        tokenized = self.inputs.tokenize(prompt, params)
        request = Request(request_id, tokenized.token_ids, priority=priority,
                          arrival_time=arrival_time, tenant=tenant)
        request.max_tokens = 0  # nothing is generated: no-evict admission reserves the prompt
        self.scheduler.add_request(request)
        self._pending[request_id] = _Pending(params, tokenized.segment_start)
        self.prompt_tokens_total += len(tokenized.token_ids)

    def step(self) -> list[PoolingRequestOutput]:
        """One scheduler step; the outputs of the requests whose prompt it completed.
        Raises PoolingStepFailed (the step's requests aborted) when the forward fails."""
        out = self.scheduler.schedule()
        self.last_step_num_tokens = 0
        if not out.scheduled_requests:
            if out.finished_req_ids:
                self.runner.execute(out, {})  # only drops the runner's state for them
            return []
        if self._threads is not None:
            self._threads.adapt()
        pending = self._pending
        ids = [r.request_id for r in out.scheduled_requests]
        try:
            vectors = self.runner.execute(out, {rid: pending[rid].params for rid in ids},
                                          {rid: pending[rid].segment_start for rid in ids})
        except Exception as exc:
            logger.exception("pooling step failed; aborting %d requests", len(ids))
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for rid in ids:
                pending.pop(rid, None)
            # Blocks registered at allocation may never have been written.
            self.scheduler.kv_cache_manager.reset_prefix_cache()
            raise PoolingStepFailed(f"model execution failed: {exc}", ids) from exc
        self.last_step_num_tokens = out.total_num_scheduled_tokens
        outputs = []
        for request in self.scheduler.finish_pooled(out):
            del pending[request.request_id]
            outputs.append(PoolingRequestOutput(
                request.request_id, PoolingOutput(vectors[request.request_id]),
                request.prompt_token_ids, max(request.num_cached_tokens, 0), finished=True))
        return outputs

    def abort_request(self, request_ids: str | Iterable[str]) -> list[PoolingRequestOutput]:
        """Finished outputs with no vector, one per request that was still pending."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = self.scheduler.finish_requests(list(request_ids),
                                                 RequestStatus.FINISHED_ABORTED)
        for request in aborted:
            self._pending.pop(request.request_id, None)
        return [PoolingRequestOutput(r.request_id, None, r.prompt_token_ids,
                                     max(r.num_cached_tokens, 0), finished=True)
                for r in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
