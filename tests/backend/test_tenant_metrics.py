"""backend.tenant_metrics against a stand-in for pb_utils.MetricFamily (Triton is not
needed to check which series it sets to what; tests/e2e/test_llm_fair.py scrapes the real
ones)."""
from types import SimpleNamespace

from backend.tenant_metrics import TenantMetrics


class Series:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def increment(self, amount):
        self.value += amount

    def set(self, value):
        self.value = value


class Family:
    COUNTER, GAUGE = "counter", "gauge"
    made: dict = {}

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):
        series = Family.made[(self.name, labels["tenant"])] = Series(labels)
        return series


def stats(served, waiting):
    return SimpleNamespace(tenant_tokens_served=served, tenant_waiting=waiting)


def test_served_tokens_accumulate_and_waiting_drops_to_zero():
    Family.made = {}
    metrics = TenantMetrics(Family, {"model": "llm"})
    metrics.record(stats({"a": 10}, {"a": 2, "b": 1}))
    metrics.record(stats({"a": 25, "b": 4}, {"a": 1}))
    served = {t: s.value for (n, t), s in Family.made.items() if n.endswith("served_total")}
    waiting = {t: s.value for (n, t), s in Family.made.items() if n.endswith("waiting")}
    assert served == {"a": 25.0, "b": 4.0}
    assert waiting == {"a": 1.0, "b": 0.0}
    assert Family.made[("tle:tenant_requests_waiting", "a")].labels == {"model": "llm",
                                                                       "tenant": "a"}
    metrics.record(stats({"a": 5}, {}))  # the engine restarted its counts
    assert Family.made[("tle:tenant_tokens_served_total", "a")].value == 30.0
