"""The soak bench's phases against one running SoakServer; each returns a PhaseResult.

Client work runs on one asyncio loop per phase; the server's gauges and counters are read
between loops, or from a worker thread while streams are open."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from bench.soak_client import CancelPlan, Outcome, SoakClient, StreamJob, encode_request, percentile_ms
from bench.soak_requests import GoodRequest, Reference, bad_requests, mixed_requests
from bench.soak_server import MAIN, SoakServer

DRAIN_TIMEOUT_S = 60.0


@dataclass(slots=True)
class PhaseResult:
    phase: str
    requests: int
    errors: int = 0  # a good request that failed, or a bad one that was not refused as such
    mismatches: int = 0  # a served text that differs from the in-process engine's
    leaked_kv: float = 0.0  # vllm:kv_cache_usage_perc once the phase drained
    itl_p50_ms: float = float("nan")
    itl_p99_ms: float = float("nan")
    seconds: float = 0.0
    figures: dict[str, float] = field(default_factory=dict)  # phase-specific, named
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.failures or self.errors or self.mismatches or self.leaked_kv)

    def check(self, ok: bool, failure: str) -> None:
        if not ok:
            self.failures.append(failure)


@dataclass(slots=True)
class PhaseContext:
    server: SoakServer
    reference: Reference
    rng: random.Random
    max_model_len: int


async def run_jobs(url: str, jobs: list[StreamJob]) -> list[StreamJob]:
    client = SoakClient(url)
    try:
        return await asyncio.gather(*(client.run(job) for job in jobs))
    finally:
        await client.close()


def single_job(model: str, request_id: str, good: GoodRequest,
               cancel: CancelPlan | None = None) -> StreamJob:
    return StreamJob([encode_request(model, request_id, good.tensors())], cancel=cancel)


def compare_outputs(result: PhaseResult, outcomes: list[Outcome], expected: list[str],
                    partial_ok: bool = False) -> None:
    """Counts failed requests and texts that differ; a cancelled request must be a prefix."""
    for outcome, want in zip(outcomes, expected):
        if outcome.error is not None or not (outcome.final or (partial_ok and outcome.cancelled)):
            result.errors += 1
            if len(result.failures) < 5:
                result.failures.append(f"{outcome.request_id}: {outcome.error or 'no final response'}")
        elif outcome.text != want and not (outcome.cancelled and not outcome.final
                                            and want.startswith(outcome.text)):
            result.mismatches += 1
            if len(result.failures) < 5:
                common = next((k for k, (a, b) in enumerate(zip(outcome.text, want)) if a != b),
                              min(len(outcome.text), len(want)))
                result.failures.append(f"{outcome.request_id} differs from char {common}: served "
                                       f"{outcome.text[common:common + 40]!r}, in-process "
                                       f"{want[common:common + 40]!r}")


def drain(ctx: PhaseContext, model: str, result: PhaseResult) -> None:
    gauges, waited = ctx.server.wait_until(model, lambda g: g.idle, DRAIN_TIMEOUT_S)
    result.leaked_kv = gauges.kv_usage
    result.notes.append(f"drained to kv={gauges.kv_usage:g} running={gauges.running:g} "
                        f"waiting={gauges.waiting:g} in {waited:.1f} s")
    result.check(gauges.idle, f"{model} not idle {DRAIN_TIMEOUT_S:.0f} s after the phase: {gauges}")
    result.check(ctx.server.alive(), "server not ready after the phase")


def record_itl(result: PhaseResult, outcomes: list[Outcome]) -> None:
    gaps = [gap for o in outcomes for gap in o.inter_token_latencies()]
    result.itl_p50_ms, result.itl_p99_ms = percentile_ms(gaps, 50), percentile_ms(gaps, 99)


def load_phase(ctx: PhaseContext, streams: int) -> PhaseResult:
    goods = mixed_requests(streams, ctx.rng)
    expected = ctx.reference.texts(goods)
    result = PhaseResult("load", streams)
    started = time.perf_counter()
    jobs = asyncio.run(run_jobs(ctx.server.grpc_url,
                                [single_job(MAIN, f"load-{i}", g) for i, g in enumerate(goods)]))
    result.seconds = time.perf_counter() - started
    outcomes = [job.outcomes[f"load-{i}"] for i, job in enumerate(jobs)]
    compare_outputs(result, outcomes, expected)
    record_itl(result, outcomes)
    tokens = sum(len(o.arrivals) for o in outcomes)
    result.notes.append(f"{tokens} streamed responses, {tokens / result.seconds:.0f}/s")
    drain(ctx, MAIN, result)
    return result


def cancel_phase(ctx: PhaseContext, streams: int) -> PhaseResult:
    goods = mixed_requests(streams, ctx.rng)
    expected = ctx.reference.texts(goods)
    doomed = set(ctx.rng.sample(range(streams), streams // 2))
    jobs = []
    for i, good in enumerate(goods):
        plan = None
        if i in doomed:
            after = ctx.rng.randint(0, good.sampling["max_tokens"] - 1)
            plan = CancelPlan(after, ctx.rng.uniform(0.0, 0.05) if after == 0 else 0.0)
        jobs.append(single_job(MAIN, f"cancel-{i}", good, plan))
    result = PhaseResult("cancel", streams)
    started = time.perf_counter()
    jobs = asyncio.run(run_jobs(ctx.server.grpc_url, jobs))
    result.seconds = time.perf_counter() - started
    outcomes = [job.outcomes[f"cancel-{i}"] for i, job in enumerate(jobs)]
    compare_outputs(result, outcomes, expected, partial_ok=True)
    kept = [o for i, o in enumerate(outcomes) if i not in doomed]
    result.check(all(o.final for o in kept), "a stream the client kept did not finish")
    record_itl(result, kept)
    result.figures["cancelled"] = sum(o.cancelled for o in outcomes)
    result.notes.append(f"{sum(o.cancelled for o in outcomes)} cancelled by the client "
                        f"({len(doomed)} planned; a short request may finish first)")
    drain(ctx, MAIN, result)
    return result


def bad_phase(ctx: PhaseContext, rounds: int, good_count: int) -> PhaseResult:
    bads = [b for _ in range(rounds) for b in bad_requests(ctx.max_model_len)]
    goods = mixed_requests(good_count, ctx.rng)
    expected = ctx.reference.texts(goods)
    order = [("bad", i) for i in range(len(bads))] + [("good", i) for i in range(len(goods))]
    ctx.rng.shuffle(order)
    jobs = [StreamJob([encode_request(MAIN, f"{kind}-{i}",
                                      bads[i].tensors if kind == "bad" else goods[i].tensors())])
            for kind, i in order]
    result = PhaseResult("bad", len(jobs))
    started = time.perf_counter()
    jobs = asyncio.run(run_jobs(ctx.server.grpc_url, jobs))
    result.seconds = time.perf_counter() - started
    by_id = {rid: o for job in jobs for rid, o in job.outcomes.items()}
    good_outcomes = [by_id[f"good-{i}"] for i in range(len(goods))]
    compare_outputs(result, good_outcomes, expected)
    record_itl(result, good_outcomes)
    result.figures["bad_refused"] = 0
    for i, bad in enumerate(bads):
        outcome = by_id[f"bad-{i}"]
        refused = outcome.error is not None and not outcome.pieces and bad.fragment in outcome.error
        result.figures["bad_refused"] += refused
        if not refused:
            result.errors += 1
            result.failures.append(f"bad request '{bad.kind}' got {outcome.error or outcome.text!r}"[:300])
        elif "engine step failed" in outcome.error:
            result.failures.append(f"bad request '{bad.kind}' reached the engine step: {outcome.error}")
    result.notes.append(f"{len(bads)} bad ({len(bads) // max(rounds, 1)} kinds x {rounds}), "
                        f"{len(goods)} good, interleaved")
    drain(ctx, MAIN, result)
    return result
