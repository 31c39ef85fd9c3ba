"""Whom the scheduler preempts when a running request finds no free block."""
from __future__ import annotations

from engine.config import SchedulerConfig
from engine.core.fair_share import VirtualTokenCounter, tenant_of
from engine.core.request import Request

# policy="fair": the preemption that makes a request the anchor (the progress rule, in the
# Scheduler docstring). The first preemption is the policy doing its job; a second one of
# the same request is the first sign of two tenants taking the pool from each other in
# turn, so that is where the policy stops having the last word. Any value >= 1 ends such a
# cycle; a higher one lets it waste more recompute first (the pinned two-tenant workload in
# tests/engine/core/test_scheduler_properties.py: 3 preemptions at 1, 4 at 2, 6 at 3).
ANCHOR_PREEMPTIONS = 2


def policy_order(running: list[Request], config: SchedulerConfig,
                 fair: VirtualTokenCounter | None) -> list[Request]:
    """Running requests, most deserving first: fcfs in admission order; priority by
    (priority, arrival); fair by tenant counter, then admission order."""
    if config.policy == "priority":
        return sorted(running, key=lambda r: (r.priority, r.arrival_time))
    if fair is not None:
        return sorted(running, key=lambda r: fair.counter(tenant_of(r)))
    return running


def pick_victim(running: list[Request], config: SchedulerConfig, num_steps: int,
                fair: VirtualTokenCounter | None = None,
                anchor: Request | None = None) -> Request:
    """The policy's last request (fcfs: the latest admitted; priority: the lowest priority,
    then the latest arrival; fair: the latest admitted of the tenant with the highest
    counter), which has the least work to lose.

    With `shield_resumed`, a request readmitted after k preemptions is passed over for k
    steps (the step after its readmission, then longer each time it is preempted again)
    while a request other than the policy's first is unshielded. Without the shield, a
    request readmitted with room for only its first chunk evicts itself at its next chunk,
    every time, until memory frees up (vllm#25538); with it, it gets k chunks to finish its
    recompute, at the cost of evicting requests with more work done (random workloads that
    preempt recompute ~16% more tokens on average; tests/engine/core/test_scheduler.py has
    the scenario). The policy's first request is never the victim while another runs, and
    neither is `anchor` (the scheduler's progress rule, engine/core/scheduler.py)."""
    if anchor is not None and len(running) > 1:
        running = [r for r in running if r is not anchor]
    if config.policy == "priority":
        victim = max(running, key=lambda r: (r.priority, r.arrival_time))
    elif fair is not None:
        victim = policy_order(running, config, fair)[-1]
    else:
        victim = running[-1]
    if not config.shield_resumed or len(running) == 1:
        return victim
    others = policy_order(running, config, fair)[1:]
    unshielded = [r for r in others if num_steps - r.resumed_at_step > r.num_preemptions]
    return (unshielded or others)[-1]
