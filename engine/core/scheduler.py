"""vLLM-V1-style scheduler: one token budget per step, RUNNING first, then WAITING;
prefill and decode are the same thing (computed tokens catching up with tokens).

Over 300 lines: schedule() is vLLM V1's one pass (running, then waiting, then the
output) whose phases share the step's budget and lists; admission, queues and partial
prefills already live beside it."""
from __future__ import annotations

import time

from engine.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine.core import admission
from engine.core.fair_queue import FairQueue
from engine.core.fair_share import VirtualTokenCounter
from engine.core.kv_cache import BlockHasher, KVCacheManager
from engine.core.kv_cache.groups import KVCacheLayout
from engine.core.partial_prefills import LOOKAHEAD, PartialPrefills
from engine.core.preemption import ANCHOR_PREEMPTIONS, pick_victim
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import make_request_queue
from engine.core.sched_output import SchedulerOutput, SchedulerStats
from engine.core.stop_checker import check_stop
from engine.spec_decode.metrics import SpecDecodingStats


class Scheduler:
    """One step per schedule() call; state lives in the requests and the KV manager.

    Progress: once arrivals stop, every request finishes within a bounded number of steps
    (no livelock) if each alone fits the pool (the engine checks max_model_len against the
    pool at start-up), under every policy, admission and shield_resumed setting;
    tests/engine/core/test_scheduler_properties.py checks a step bound. Each step the first
    request of RUNNING computes a token or someone is preempted (with RUNNING empty, the
    head of WAITING starts), so what must not happen is preemptions taking back the same
    work forever; admission="no_evict" never preempts.
    - fcfs, priority: the policy's first running request is never the victim while another
      runs (engine/core/preemption.py) and loses that place only by finishing (fcfs: the
      earliest admitted) or to a request that ranks strictly higher, finitely often (priority:
      lowest (priority, arrival)). Under fcfs it is also served first, so the run is busy for
      at most as many steps as its requests have tokens.
    - fair: the first by tenant counter changes as the counters move, so two tenants can take
      the pool from each other in turn forever (each preemption evicts the request whose
      tenant is now ahead, and the recompute puts the other one ahead). So here the request
      that is preempted for the ANCHOR_PREEMPTIONS-th time while no anchor exists becomes the
      anchor until it finishes or is aborted: it is never the victim while another request
      runs, and while it waits nothing else is admitted. Waiting, it gets in once RUNNING,
      which cannot grow meanwhile, has shrunk or advanced enough; running, it grows by a token
      each step once the requests admitted before it are done or preempted, and never fails
      to find a block, because alone it fits. So each anchor finishes, and without one a
      request can be preempted only ANCHOR_PREEMPTIONS - 1 times before one exists again.
      The cost: while an anchor lives, victims and admissions may go against the counters."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 enable_kv_events: bool = False, lora_config: LoRAConfig | None = None,
                 kv_layout: KVCacheLayout | None = None, num_spec_tokens: int = 0,
                 num_lookahead_tokens: int = 0) -> None:
        """`kv_layout`: the model's KV-cache groups (engine/core/kv_cache/groups.py); None:
        one full-attention group. `num_spec_tokens`: speculative decoding's
        num_speculative_tokens (0: off), for its counters. `num_lookahead_tokens`: slots
        kept past each scheduled request's tokens, where a draft model writes the K/V of
        its proposals between steps (vLLM's; 0 for drafts without a model)."""
        if cache_config.num_kv_blocks is None:
            raise ValueError("cache_config.num_kv_blocks must be set before building a Scheduler")
        if scheduler_config.max_model_len is None:
            raise ValueError("scheduler_config.max_model_len must be set before building a Scheduler")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            hasher=BlockHasher(cache_config.prefix_caching_hash_algo),
            enable_events=enable_kv_events, layout=kv_layout)
        self.watermark_blocks = cache_config.watermark_blocks
        # None: no limit (LoRA off); else the distinct adapters RUNNING may hold.
        self.max_loras = lora_config.max_loras if lora_config and lora_config.enable_lora else None
        self.requests: dict[str, Request] = {}
        # policy="fair" only: the tenants' virtual token counters.
        self.fair = VirtualTokenCounter(scheduler_config) if scheduler_config.policy == "fair" \
            else None
        self.waiting = (make_request_queue(scheduler_config.policy) if self.fair is None
                        else FairQueue(self.fair))
        self.running: list[Request] = []
        # policy="fair" only: the request the progress rule protects (class docstring).
        self.anchor: Request | None = None
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.spec_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        self.num_lookahead_tokens = num_lookahead_tokens

    # ---- requests in and out -------------------------------------------------
    def check_new_request(self, request_id: str, num_prompt_tokens: int) -> None:
        """What add_request refuses, for a caller to ask before it builds the request."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if num_prompt_tokens == 0:
            raise ValueError("prompt is empty")
        if num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, which does not leave room "
                             f"for output within max_model_len={self.config.max_model_len}")

    def add_request(self, request: Request) -> None:
        self.check_new_request(request.request_id, request.num_prompt_tokens)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if self.fair is not None:
            self.fair.join(request)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED
                        ) -> list[Request]:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request is self.anchor:
            self.anchor = None
        if self.fair is not None:
            self.fair.leave(request)
        self.finished_req_ids.add(request.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    # ---- one step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        self.num_steps += 1
        token_budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        prefills = PartialPrefills.for_step(cfg)
        num_scheduled: dict[str, int] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []

        running = self.running
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            # Proposed tokens ride along (vLLM's num_tokens_with_spec); they are what a cut
            # below takes first.
            num_new = remaining + len(request.spec_token_ids)
            if prefills is not None and remaining > 1:
                if not prefills.admits(remaining):
                    i += 1  # keeps its blocks; resumes when a prefill slot frees up
                    continue
                num_new = min(num_new, prefills.chunk_cap)
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, token_budget, cfg.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            lookahead = self.lookahead_slots(request.num_computed_tokens + num_new)
            while True:
                if kv.allocate_slots(request, num_new,
                                     num_lookahead_tokens=lookahead) is not None:
                    break
                victim = pick_victim(running, cfg, self.num_steps, self.fair, self.anchor)
                victim_index = running.index(victim)
                running.pop(victim_index)
                if victim.request_id in num_scheduled:
                    # Granted this step already (priority, fair): take the grant back.
                    token_budget += num_scheduled.pop(victim.request_id)
                    scheduled_running.remove(victim)
                if victim_index < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            if prefills is not None and remaining > 1:
                prefills.take(remaining)
            if request.spec_token_ids:
                del request.spec_token_ids[max(num_new - remaining, 0):]
            num_scheduled[request.request_id] = num_new
            scheduled_running.append(request)
            token_budget -= num_new
            i += 1

        if self.fair is not None:
            for request in scheduled_running:
                self.fair.charge(request, num_scheduled[request.request_id])
        admitted: list[Request] = []
        # Admitting while preempting would only thrash: whoever was just evicted is
        # at the head of WAITING and cannot fit anyway.
        if not preempted:
            token_budget = self._admit(token_budget, prefills, num_scheduled, admitted)

        # Admission order matters: a later admission may hit prefix blocks that an
        # earlier one fills in this very step.
        scheduled = scheduled_running + admitted
        tables = kv.req_to_block_ids
        block_ids = {}
        # V1 convention: progress counts what is scheduled, before it is computed.
        if kv.num_groups == 1:  # the common case, kept to one copy per request
            for request in scheduled:
                request.num_computed_tokens += num_scheduled[request.request_id]
                block_ids[request.request_id] = (tables[request.request_id][0].copy(),)
        else:
            for request in scheduled:
                request.num_computed_tokens += num_scheduled[request.request_id]
                block_ids[request.request_id] = tuple(map(list.copy, tables[request.request_id]))
        out = SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - token_budget,
            block_ids=block_ids,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens={r.request_id: r.spec_token_ids
                                          for r in scheduled_running if r.spec_token_ids},
        )
        self.finished_req_ids = set()
        return out

    def _admit(self, token_budget: int, prefills: PartialPrefills | None,
               num_scheduled: dict[str, int], admitted: list[Request]) -> int:
        """Move WAITING requests to RUNNING in queue order while budget, seats and blocks
        last; returns the budget left. With prefill limits, a long prompt that finds the
        long slots taken is passed over (it keeps its place) and shorter ones behind it
        may start, looking at most LOOKAHEAD requests past max_num_seqs."""
        cfg, kv, waiting, running = self.config, self.kv_cache_manager, self.waiting, self.running
        threshold = cfg.long_prefill_token_threshold
        candidates = None
        if self.anchor is not None and self.anchor.status == RequestStatus.PREEMPTED:
            # The anchor waits: it alone may start (the progress rule), else whoever started
            # in its place could take the blocks it needs, and the cycle goes on.
            candidates = iter((self.anchor,))
        elif prefills is not None:
            candidates = iter(waiting.head(cfg.max_num_seqs + LOOKAHEAD))
        # vLLM's max_loras rule: a request whose adapter would make one too many is passed
        # over (it keeps its place), so requests for adapters already running still start.
        loras = None if self.max_loras is None else {
            r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        skipped: list[Request] = []
        no_evict = cfg.admission == "no_evict"
        # A step's chunk is at most the token budget: what bounds a windowed group's worst.
        max_chunk = cfg.max_num_batched_tokens
        reserved = (admission.reserved_blocks(running, kv, cfg.max_model_len, max_chunk)
                    if no_evict else 0)
        while waiting and token_budget > 0 and len(running) < cfg.max_num_seqs:
            if candidates is None:
                request = waiting.peek()
            else:
                request = next(candidates, None)
                if request is None or (prefills is not None and prefills.full()):
                    break
            lora = request.lora_request
            if (loras is not None and lora is not None and lora.lora_int_id not in loras
                    and len(loras) >= self.max_loras):
                if candidates is None:
                    skipped.append(waiting.pop())
                continue
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            remaining = request.num_tokens - num_hit_tokens
            num_new = remaining
            if prefills is not None:
                if not prefills.admits(remaining):
                    continue
                num_new = min(num_new, prefills.chunk_cap)
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, token_budget)
            if no_evict and not admission.fits(request, hit_blocks, kv, cfg.max_model_len,
                                               max_chunk, reserved, self.watermark_blocks):
                break
            if kv.allocate_slots(request, num_new, hit_blocks, self.watermark_blocks,
                                 self.lookahead_slots(num_hit_tokens + num_new)) is None:
                break
            waiting.remove(request)
            if prefills is not None:
                prefills.take(remaining)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
            if request.num_preemptions:
                request.resumed_at_step = self.num_steps
            kv.record_prefix_lookup(request, num_hit_tokens)
            admitted.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            running.append(request)
            if no_evict:
                reserved += admission.still_needed(request, kv, cfg.max_model_len, max_chunk)
            if self.fair is not None:
                self.fair.charge(request, num_new)
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
            if loras is not None and lora is not None:
                loras.add(lora.lora_int_id)
        for request in reversed(skipped):
            waiting.prepend(request)
        return token_budget

    def _preempt(self, request: Request) -> None:
        # Progress is only committed at the end of schedule(), so num_computed_tokens
        # here counts exactly the tokens whose KV exists.
        self.kv_cache_manager.free(request, num_valid_tokens=request.num_computed_tokens)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if (self.anchor is None and self.fair is not None
                and request.num_preemptions >= ANCHOR_PREEMPTIONS):
            # Preempted again: the counters are trading the pool back and forth; from here
            # on this request keeps what it gets (the progress rule, class docstring).
            self.anchor = request
        self.waiting.prepend(request)

    # ---- results of a step ----------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        """Append sampled tokens, finish the requests that stop (engine/core/stop_checker.py
        decides) and free them. Tokens after a stop in the same step are dropped. Returns
        the requests that got tokens, finished ones included."""
        updated: list[Request] = []
        max_model_len = self.config.max_model_len
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for request in scheduler_output.scheduled_requests:
            if request.status != RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            new_ids = sampled_token_ids.get(request.request_id)
            if drafts and request.request_id in drafts:
                self._settle_draft(request, len(drafts[request.request_id]),
                                   len(new_ids) - 1 if new_ids else 0)
            if not new_ids:
                continue
            updated.append(request)
            for token_id in new_ids:
                request.all_token_ids.append(token_id)
                self.generation_tokens_total += 1
                stop = check_stop(request, token_id, max_model_len)
                if stop is not None:
                    request.status = stop.status
                    request.stop_reason = stop.stop_reason
                    request.finished_on_stop_token = stop.on_stop_token
                    self.running.remove(request)
                    self._free(request)
                    break
        return updated

    def _settle_draft(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """A verified draft: the rejected tokens' K/V is given back (their positions are
        computed again, the blocks past the accepted ones are freed; none of them was ever
        hashed, since only tokens in all_token_ids are), so the request stands as if it
        had never proposed them (but for the lookahead slots a draft model keeps)."""
        request.num_computed_tokens -= num_draft - num_accepted
        self._drop_draft(request)
        if self.spec_stats is not None:
            self.spec_stats.observe(num_draft, num_accepted)

    def _drop_draft(self, request: Request) -> None:
        """Forget the request's draft and free the blocks past its computed tokens (and
        their lookahead slots)."""
        request.spec_token_ids = []
        computed = request.num_computed_tokens
        self.kv_cache_manager.trim(request, computed + self.lookahead_slots(computed))

    def lookahead_slots(self, num_tokens: int) -> int:
        """The lookahead slots a request with `num_tokens` computed (or scheduled) tokens
        keeps: none past max_model_len, where no draft is ever proposed."""
        return max(0, min(self.num_lookahead_tokens, self.config.max_model_len - num_tokens))

    def retry_sampling(self, requests: list[Request]) -> None:
        """A step computed these requests' tokens but sampled none: step back one token
        for those due a sample, so the next schedule() recomputes the last token (its K/V
        is rewritten with the same values) and samples it. Requests mid-prefill were due
        no sample and keep their progress."""
        for request in requests:
            if (request.status == RequestStatus.RUNNING
                    and request.num_computed_tokens >= request.num_tokens):
                request.num_computed_tokens = request.num_tokens - 1
                if request.spec_token_ids:
                    self._drop_draft(request)

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions_total=self.num_preemptions_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_decoding=self.spec_stats,
            **(self._lora_counts() if self.max_loras is not None else {}),
            **({} if self.fair is None else {
                "tenant_waiting": self.waiting.waiting_by_tenant(),
                "tenant_tokens_served": dict(self.fair.tokens_served)}))

    def _lora_counts(self) -> dict[str, dict[str, int]]:
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for requests, counts in ((self.running, running), (self.waiting, waiting)):
            for request in requests:
                if request.lora_request is not None:
                    name = request.lora_request.lora_name
                    counts[name] = counts.get(name, 0) + 1
        names = list(dict.fromkeys([*running, *waiting]))
        return {"running_lora_adapters": {n: running.get(n, 0) for n in names},
                "waiting_lora_adapters": {n: waiting.get(n, 0) for n in names}}
