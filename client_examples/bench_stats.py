"""Turns what the client observed into latency and throughput numbers; no I/O here."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from client_examples.common import GenerationRecord

TOKENS_FROM_SERVER = "num_output_tokens"
TOKENS_FROM_WORDS = "whitespace_words"


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class LatencySummary:
    """Milliseconds."""
    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> "LatencySummary":
        ms = [v * 1000.0 for v in values]
        mean = sum(ms) / len(ms) if ms else math.nan
        return cls(len(ms), mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass
class RequestMetrics:
    ttft: Optional[float]  # seconds to the first non-empty text delta
    itl: list[float]  # one sample per output token after the first response with tokens
    e2e: float
    output_tokens: int
    token_source: str


def cumulative_tokens(record: GenerationRecord) -> tuple[list[int], str]:
    """Output tokens generated so far, after each response.

    Uses the server's num_output_tokens when any response carries it (in streaming mode,
    as in vllm_backend, each response counts the tokens new since the previous one); otherwise
    counts whitespace-separated words of the text so far. Counting words of the accumulated
    text rather than of each delta keeps a word split across two deltas from counting twice.
    """
    if any(c.num_output_tokens is not None for c in record.chunks):
        counts, last = [], 0
        for c in record.chunks:
            if c.num_output_tokens is not None:
                last += c.num_output_tokens
            counts.append(last)
        return counts, TOKENS_FROM_SERVER
    counts, text = [], ""
    for c in record.chunks:
        text += c.text
        counts.append(len(text.split()))
    return counts, TOKENS_FROM_WORDS


def request_metrics(record: GenerationRecord) -> RequestMetrics:
    if not record.ok:
        raise ValueError(f"request did not complete: {record.error}")
    counts, source = cumulative_tokens(record)
    ttft = next((c.t - record.send_time for c in record.chunks if c.text), None)
    itl: list[float] = []
    prev_count, prev_t = 0, None
    for chunk, count in zip(record.chunks, counts):
        new = count - prev_count
        if new <= 0:
            continue  # no tokens: its gap rolls into the next response that has some
        if prev_t is not None:
            # A response carrying several tokens spreads its gap evenly over them, so the
            # distribution is per token, not per response.
            itl.extend([(chunk.t - prev_t) / new] * new)
        prev_count, prev_t = count, chunk.t
    return RequestMetrics(ttft, itl, record.end_time - record.send_time, counts[-1] if counts else 0, source)


@dataclass
class LevelResult:
    mode: str  # "concurrency" (closed loop) or "rate" (open loop, requests/s)
    load: float  # concurrency N or request rate (inf = all at once)
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    token_source: str  # which way output tokens were counted
    length_mismatches: int  # completed requests whose token count differs from the one asked for
    ttft_ms: LatencySummary
    itl_ms: LatencySummary
    e2e_ms: LatencySummary
    tpot_ms: LatencySummary  # per request: (e2e - ttft) / (tokens - 1)
    errors: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"conc {int(self.load)}"
        return "rate inf" if math.isinf(self.load) else f"rate {self.load:g}/s"


def summarize_level(mode: str, load: float, records: Sequence[GenerationRecord],
                    expected_tokens: Sequence[int], duration_s: float) -> LevelResult:
    done = [(r, n) for r, n in zip(records, expected_tokens) if r.ok]
    metrics = [request_metrics(r) for r, _ in done]
    sources = sorted({m.token_source for m in metrics})
    total_tokens = sum(m.output_tokens for m in metrics)
    tpot = [(m.e2e - m.ttft) / (m.output_tokens - 1) for m in metrics
            if m.ttft is not None and m.output_tokens > 1]
    errors = sorted({r.error for r in records if not r.ok and r.error})
    return LevelResult(
        mode=mode, load=load, completed=len(done), failed=len(records) - len(done),
        duration_s=duration_s, output_tokens=total_tokens,
        output_tokens_per_s=total_tokens / duration_s if duration_s > 0 else math.nan,
        requests_per_s=len(done) / duration_s if duration_s > 0 else math.nan,
        token_source="+".join(sources) or "none",
        length_mismatches=sum(1 for m, (_, n) in zip(metrics, done) if m.output_tokens != n),
        ttft_ms=LatencySummary.of_seconds([m.ttft for m in metrics if m.ttft is not None]),
        itl_ms=LatencySummary.of_seconds([x for m in metrics for x in m.itl]),
        e2e_ms=LatencySummary.of_seconds([m.e2e for m in metrics]),
        tpot_ms=LatencySummary.of_seconds(tpot),
        errors=errors[:5],
    )


def format_table(levels: Sequence[LevelResult]) -> str:
    head = (f"{'load':<12}{'ok/fail':>9}  {'TTFT ms p50/p90/p99':>22}  {'ITL ms p50/p90/p99':>22}  "
            f"{'E2E ms p50/p90/p99':>24}  {'out tok/s':>9}  {'req/s':>6}")
    rows = [head, "-" * len(head)]

    def three(s: LatencySummary, width: int, prec: int) -> str:
        return f"{s.p50:.{prec}f}/{s.p90:.{prec}f}/{s.p99:.{prec}f}".rjust(width)

    for lv in levels:
        rows.append(f"{lv.label:<12}{f'{lv.completed}/{lv.failed}':>9}  {three(lv.ttft_ms, 22, 1)}  "
                    f"{three(lv.itl_ms, 22, 2)}  {three(lv.e2e_ms, 24, 0)}  "
                    f"{lv.output_tokens_per_s:>9.1f}  {lv.requests_per_s:>6.2f}")
    return "\n".join(rows)
