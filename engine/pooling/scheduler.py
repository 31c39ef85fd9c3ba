"""The scheduler for pooling requests: engine/core/scheduler.py's, so a pooling request
takes the same token budget, seats, KV blocks, chunked prefill, prefix-cache hits,
preemption and queue policy as a generation request. Two differences, both vLLM's:

- A pooling request needs no token after its prompt: it finishes when the step that
  computes its prompt's last chunk has run (`finish_pooled`), and its blocks are freed
  then. So its prompt may fill max_model_len (a generation prompt must leave a token).
- `whole_prompts` (encoders: bidirectional attention needs the whole sequence in one
  forward, and they keep no KV to resume from): a request is admitted only with its whole
  prompt, vLLM's scheduler with chunked prefill off. The first request that does not fit
  the step's remaining budget stops admission and waits at the head of the queue. The KV
  pool is then a ledger only (no tensors behind it), sized so it never runs out.

Torch-free, as engine/core is."""
from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache import KVCacheManager
from engine.core.kv_cache.groups import KVCacheLayout
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import Scheduler


class WholePromptKVCacheManager(KVCacheManager):
    """Grants only allocations that cover a request's whole remaining prompt: a partial
    grant reads as "does not fit", which the scheduler's admission loop answers by
    stopping, before it charges or records anything for the request."""

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks=None, num_reserved_blocks: int = 0,
                       num_lookahead_tokens: int = 0):
        if request.num_computed_tokens + num_new_tokens < request.num_tokens:
            return None
        return super().allocate_slots(request, num_new_tokens, new_computed_blocks,
                                      num_reserved_blocks, num_lookahead_tokens)


class PoolingScheduler(Scheduler):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_layout: KVCacheLayout | None = None, whole_prompts: bool = False) -> None:
        if whole_prompts:
            check_whole_prompt_config(scheduler_config)
        super().__init__(scheduler_config, cache_config, kv_layout=kv_layout)
        self.whole_prompts = whole_prompts
        if whole_prompts:
            self.kv_cache_manager = WholePromptKVCacheManager(
                cache_config.num_kv_blocks, cache_config.block_size, enable_caching=False,
                layout=kv_layout)

    def check_new_request(self, request_id: str, num_prompt_tokens: int) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if num_prompt_tokens == 0:
            raise ValueError("prompt is empty")
        if num_prompt_tokens > self.config.max_model_len:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, more than "
                             f"max_model_len={self.config.max_model_len}")

    def finish_pooled(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The scheduled requests whose prompt the step completed: finished (status
        FINISHED_STOPPED) and freed. Run after the step's forward."""
        done = []
        for request in scheduler_output.scheduled_requests:
            if (request.status == RequestStatus.RUNNING
                    and request.num_computed_tokens >= request.num_tokens):
                request.status = RequestStatus.FINISHED_STOPPED
                self.running.remove(request)
                self._free(request)
                done.append(request)
        return done


def check_whole_prompt_config(scheduler_config: SchedulerConfig) -> None:
    """What would keep a whole prompt from ever being admitted, or mean nothing here."""
    cfg = scheduler_config
    if cfg.max_num_batched_tokens < cfg.max_model_len:
        raise ValueError(f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) is smaller "
                         f"than max_model_len ({cfg.max_model_len}): an encoder computes a "
                         "prompt in one step, so a prompt of max_model_len could never "
                         "run; raise max_num_batched_tokens or lower max_model_len")
    for name in ("long_prefill_token_threshold", "max_num_partial_prefills"):
        if getattr(cfg, name):
            raise ValueError(f"{name}: an encoder does not chunk its prompts (it computes "
                             "each in one step); leave it 0")
