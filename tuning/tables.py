"""The replay's and the live tuner's tables: measured beside predicted, with the error."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tuning.replay import Summary


def comparison_table(actual: Summary, predicted: Summary) -> str:
    rows = [("TTFT p50 s", actual.ttft["p50"], predicted.ttft["p50"]),
            ("TTFT p90 s", actual.ttft["p90"], predicted.ttft["p90"]),
            ("ITL p50 s", actual.itl["p50"], predicted.itl["p50"]),
            ("ITL p90 s", actual.itl["p90"], predicted.itl["p90"]),
            ("e2e p50 s", actual.e2e["p50"], predicted.e2e["p50"]),
            ("output tok/s", actual.output_tokens_per_s, predicted.output_tokens_per_s),
            ("preemptions", actual.preemptions, predicted.preemptions),
            ("prefix hit rate", actual.prefix_hit_rate, predicted.prefix_hit_rate)]
    spec = (actual.extra.get("speculative"), predicted.extra.get("speculative"))
    if all(spec):  # speculative decoding: its acceptance rate and tokens per draft
        rows += [("accepted / drafted",
                  *(_ratio(t, "accepted_tokens", "draft_tokens") for t in spec)),
                 ("tokens per draft",
                  *(1 + _ratio(t, "accepted_tokens", "num_drafts") for t in spec))]
    return error_table(rows, ("measured", "replay"), label_width=18)


def error_table(rows: list[tuple[str, float, float]], headers: tuple[str, str],
                label_width: int, predicted_first: bool = False) -> str:
    """Rows of (name, measured, predicted) as a table with the prediction's error against
    the measurement, the two value columns under `headers` in print order."""
    lines = [f"{'':{label_width}s}{headers[0]:>12s}{headers[1]:>12s}{'error':>9s}"]
    for name, a, p in rows:
        error = f"{p / a - 1:+.1%}" if a else "-"
        first, second = (p, a) if predicted_first else (a, p)
        lines.append(f"{name:{label_width}s}{first:12.4g}{second:12.4g}{error:>9s}")
    return "\n".join(lines)


def _ratio(totals: dict[str, int], numerator: str, denominator: str) -> float:
    return totals[numerator] / totals[denominator] if totals[denominator] else 0.0
