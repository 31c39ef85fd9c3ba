"""What one schedule() hands the model runner, and the scheduler's counters (vLLM's
v1/core/sched/output.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request
from engine.spec_decode.metrics import SpecDecodingStats


@dataclass(slots=True)
class SchedulerOutput:
    """What the runner needs for one step; nothing in it changes after schedule()."""
    # Batch order for the runner: running requests, then admissions in admission order.
    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Each scheduled request's block tables, one per KV-cache group (a 1-tuple for a model
    # of one group), copied: a free later in the step cannot touch them. A windowed
    # group's entries behind its window hold NULL_BLOCK's id (never read).
    block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    # Finished (stopped or aborted) since the previous schedule(): the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # vLLM's meaning: preempted in this step (blocks freed, back to WAITING); a request
    # may be preempted and readmitted across steps, never within one.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: each drafting request's proposed tokens this step verifies
    # (its last num_scheduled_tokens - 1 positions are them); absent: none proposed.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions_total: int
    generation_tokens_total: int
    # enable_lora only, vLLM's SchedulerStats fields: adapter name -> its requests running
    # / waiting; as vLLM 0.32 fills them, each holds every adapter that has any request.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # policy="fair" only: requests waiting per tenant (tenants with none waiting left out),
    # and tokens computed per tenant since start (engine/core/fair_share.py caps the names).
    tenant_tokens_served: dict[str, int] = field(default_factory=dict)
    tenant_waiting: dict[str, int] = field(default_factory=dict)
    # Speculative decoding on: its counters (live; the engine hands out a snapshot).
    spec_decoding: SpecDecodingStats | None = None
