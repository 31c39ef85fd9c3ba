"""Per-tenant metrics of policy="fair" (vLLM has none; `tle:` marks this backend's own):
tokens computed for each tenant, and its requests waiting. The engine caps the tenant
names it reports (engine/core/fair_share.py), so the series stay bounded."""
from __future__ import annotations

from typing import Any

from backend.metric_families import COUNTER, GAUGE, Family

TOKENS_SERVED = Family("tle:tenant_tokens_served_total", COUNTER,
                       "Tokens computed for the tenant (prompt and decode), policy=fair.",
                       label="tenant")
REQUESTS_WAITING = Family("tle:tenant_requests_waiting", GAUGE,
                          "Requests of the tenant waiting to be scheduled, policy=fair.",
                          label="tenant")


class TenantMetrics:
    def __init__(self, kinds: Any, labels: dict[str, str]) -> None:
        """`kinds`: pb_utils.MetricFamily; `labels`: the labels every series carries."""
        self._labels = labels
        # The families must outlive their series (Triton drops a collected family's).
        self._served = kinds(name=TOKENS_SERVED.name, description=TOKENS_SERVED.description,
                             kind=kinds.COUNTER)
        self._waiting = kinds(name=REQUESTS_WAITING.name,
                              description=REQUESTS_WAITING.description, kind=kinds.GAUGE)
        self._served_series: dict[str, Any] = {}
        self._waiting_series: dict[str, Any] = {}
        self._last_served: dict[str, int] = {}
        self._last_waiting: dict[str, int] = {}

    def _series(self, family: Any, cache: dict[str, Any], tenant: str) -> Any:
        series = cache.get(tenant)
        if series is None:
            series = cache[tenant] = family.Metric(labels={**self._labels, "tenant": tenant})
        return series

    def record(self, stats: Any) -> None:
        for tenant, total in stats.tenant_tokens_served.items():
            # The engine forgets a tenant's count only when it restarts its counters from 0.
            increase = total - self._last_served.get(tenant, 0)
            if increase < 0:
                increase = total
            if increase:
                self._series(self._served, self._served_series, tenant).increment(float(increase))
            self._last_served[tenant] = total
        waiting = stats.tenant_waiting
        for tenant in set(waiting) | set(self._last_waiting):
            count = waiting.get(tenant, 0)
            if self._last_waiting.get(tenant) != count:
                self._series(self._waiting, self._waiting_series, tenant).set(float(count))
        self._last_waiting = {t: n for t, n in waiting.items() if n}
