"""vLLM's spec-decode counters (vllm:spec_decode_*, backend/metric_families.py), created
only with a speculative_config, as vLLM's SpecDecodingProm does: the engine's cumulative
SpecDecodingStats (engine/spec_decode/metrics.py, EngineStats.spec_decoding) mirrored by
adding the increase since the previous record."""
from __future__ import annotations

from typing import Any

from backend.metric_families import SPEC_DECODE_FAMILIES, SPEC_DECODE_PER_POS

# SpecDecodingStats' field -> its counter.
_COUNTERS = dict(zip(("num_drafts", "num_draft_tokens", "num_accepted_tokens"),
                     (family.name for family in SPEC_DECODE_FAMILIES)))


class SpecDecodeMetrics:
    def __init__(self, kinds: Any, labels: dict[str, str], num_speculative_tokens: int) -> None:
        """`kinds`: pb_utils.MetricFamily; `labels`: the labels every series carries;
        one per-position series for each of positions 0..num_speculative_tokens-1."""
        # The families must outlive their series (Triton drops a collected family's).
        self._families = [kinds(name=family.name, description=family.description,
                                kind=kinds.COUNTER)
                          for family in (*SPEC_DECODE_FAMILIES, SPEC_DECODE_PER_POS)]
        self._series = {family.name: handle.Metric(labels=labels)
                        for family, handle in zip(SPEC_DECODE_FAMILIES, self._families)}
        self._per_pos = [self._families[-1].Metric(
            labels={**labels, SPEC_DECODE_PER_POS.label: str(position)})
            for position in range(num_speculative_tokens)]
        self._last = {attr: 0 for attr in _COUNTERS}
        self._last_per_pos = [0] * num_speculative_tokens

    def record(self, stats: Any) -> None:
        """`stats`: a SpecDecodingStats, totals since the engine started."""
        for attr, name in _COUNTERS.items():
            value = getattr(stats, attr)
            if value > self._last[attr]:
                self._series[name].increment(float(value - self._last[attr]))
                self._last[attr] = value
        for position, (series, value) in enumerate(zip(self._per_pos,
                                                       stats.num_accepted_tokens_per_pos)):
            if value > self._last_per_pos[position]:
                series.increment(float(value - self._last_per_pos[position]))
                self._last_per_pos[position] = value
