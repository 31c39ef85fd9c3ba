"""Virtual Token Counters for policy="fair" (VTC: Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024).

Each tenant has a counter of the service it got: every prompt token computed for it adds
fair_prefill_weight, every other computed token (a decode step, or an output token
recomputed after a preemption) adds fair_decode_weight, both divided by the tenant's
weight. WAITING serves the tenant with the lowest counter first, preemption takes its
victim from the tenant with the highest. A tenant that becomes active (its first live
request) is lifted to the lowest counter of the other active tenants, so time spent idle
earns it no credit to flood the others with later.

Bound (for two tenants live throughout an interval, weights 1): their counters' increments
differ by at most 2 * U, where U is the largest counter increase one tenant's already
running requests can still cause after its counter stopped being the lowest: at most
max_num_seqs requests of max_model_len tokens, each token costing at most
max(fair_prefill_weight, fair_decode_weight). tests/engine/core/test_scheduler_fair.py
measures the gap against it. While the scheduler's progress anchor lives (a request
preempted twice, engine/core/scheduler.py), it is neither a victim nor kept waiting
behind lower counters; that can widen the gap by the anchor's own service: one request
of at most max_model_len tokens.
"""
from __future__ import annotations

from engine.config import SchedulerConfig
from engine.core.request import Request

DEFAULT_TENANT = "default"
# A tenant names a metric series: bounded, printable, and past MAX_TENANT_SERIES
# tenants the rest are counted together under OTHER_TENANTS.
MAX_TENANT_LEN = 128
MAX_TENANT_SERIES = 256
OTHER_TENANTS = "other"


def check_tenant(tenant: object) -> str | None:
    """The tenant a request names, or ValueError saying what is wrong with it."""
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_LEN \
            or not tenant.isprintable():
        shown = repr(tenant) if len(repr(tenant)) <= 80 else repr(tenant)[:77] + "..."
        raise ValueError(f"tenant must be a non-empty printable string of at most "
                         f"{MAX_TENANT_LEN} characters, got {shown}")
    return tenant


def tenant_of(request: Request) -> str:
    return DEFAULT_TENANT if request.tenant is None else request.tenant


class VirtualTokenCounter:
    def __init__(self, config: SchedulerConfig) -> None:
        self.weights = dict(config.tenant_weights or {})
        self.prefill_weight = config.fair_prefill_weight
        self.decode_weight = config.fair_decode_weight
        self.counters: dict[str, float] = {}
        self.live: dict[str, int] = {}  # requests waiting or running, per tenant
        # Tokens computed per tenant since start, for metrics (cumulative, never pruned).
        self.tokens_served: dict[str, int] = {}

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def join(self, request: Request) -> None:
        tenant = tenant_of(request)
        if not self.live.get(tenant):
            others = [self.counter(t) for t, n in self.live.items() if n and t != tenant]
            if others:
                self.counters[tenant] = max(self.counter(tenant), min(others))
        self.live[tenant] = self.live.get(tenant, 0) + 1

    def leave(self, request: Request) -> None:
        tenant = tenant_of(request)
        self.live[tenant] -= 1
        if self.live[tenant]:
            return
        del self.live[tenant]
        if not self.live:
            # Idle: no one is owed anything; the counters start over.
            self.counters.clear()
            return
        # An inactive counter at or below every active one would be lifted on return
        # anyway: forgetting it changes nothing and keeps the dicts to the tenants seen lately.
        floor = min(self.counter(t) for t in self.live)
        for name in [t for t in self.counters if t not in self.live]:
            if self.counters[name] <= floor:
                del self.counters[name]

    def charge(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` granted from request.num_computed_tokens on."""
        tenant = tenant_of(request)
        start = request.num_computed_tokens
        prefill = max(0, min(request.num_prompt_tokens, start + num_tokens) - start)
        cost = prefill * self.prefill_weight + (num_tokens - prefill) * self.decode_weight
        self.counters[tenant] = self.counter(tenant) + cost / self.weights.get(tenant, 1.0)
        served = self.tokens_served
        if tenant not in served and len(served) >= MAX_TENANT_SERIES:
            tenant = OTHER_TENANTS
        served[tenant] = served.get(tenant, 0) + num_tokens
