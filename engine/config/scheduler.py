"""SchedulerConfig: the per-step budget, admission limits and the queue policy."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config.checks import check_positive

POLICIES = ("fcfs", "priority", "fair")
ADMISSIONS = ("max_utilization", "no_evict")


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
    # policy="fair" (engine/core/fair_share.py): a tenant's share is proportional to its
    # weight (default 1.0); its virtual counter grows by these weights per prompt token
    # computed and per decode step, divided by its share. 1 and 2: the VTC paper's choice.
    tenant_weights: dict[str, float] | None = None
    fair_prefill_weight: float = 1.0
    fair_decode_weight: float = 2.0
    # "no_evict" (TensorRT-LLM's GUARANTEED_NO_EVICT): admit only what fits beside the worst
    # case of everything running, so nothing is ever preempted (engine/core/admission.py).
    admission: str = "max_utilization"
    # vLLM's name: a streamed request (RequestOutputKind DELTA / CUMULATIVE) gets its first
    # output at once, then one per this many released tokens, and the final one; the held
    # deltas are merged (engine/output/output_processor.py). More means fewer responses.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            check_positive("max_model_len", self.max_model_len)
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
        check_positive("stream_interval", self.stream_interval)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        for name in ("fair_prefill_weight", "fair_decode_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.fair_prefill_weight == 0 == self.fair_decode_weight:
            raise ValueError("fair_prefill_weight and fair_decode_weight cannot both be 0")
        for tenant, weight in (self.tenant_weights or {}).items():
            if (not isinstance(weight, (int, float)) or isinstance(weight, bool)
                    or not 0 < weight < float("inf")):
                raise ValueError(f"tenant_weights[{tenant!r}] must be a finite number > 0, "
                                 f"got {weight!r}")
