"""Inter-token latency of one stream while thousands of requests wait, against idle.

The probe model runs one sequence at a time (max_num_seqs=1), so once the probe runs,
everything sent after it stays WAITING. The loaded figure counts only the probe's tokens
that arrived after the waiting gauge reached the crowd's size, so the cost of receiving
and tokenizing the crowd (shared CPUs) is not mistaken for the cost of its waiting."""
from __future__ import annotations

import asyncio
import time

from bench.soak_client import Outcome, SoakClient, StreamJob, encode_request, percentile_ms
from bench.soak_phases import PhaseContext, PhaseResult, compare_outputs, drain
from bench.soak_requests import greedy_request, mixed_requests
from bench.soak_server import PROBE

CROWD_PER_STREAM = 50  # requests multiplexed per gRPC stream: 5,000 need 100 streams
MIN_LOADED_GAPS = 20


async def _until(predicate, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


async def _loaded_run(ctx: PhaseContext, probe: StreamJob, crowd: list[StreamJob], size: int
                      ) -> tuple[float | None, float, list[float]]:
    """(time the crowd was all WAITING or None, seconds to get there, waiting gauge samples
    while the probe ran)."""
    client = SoakClient(ctx.server.grpc_url)
    release = asyncio.Event()
    probe_task = asyncio.create_task(client.run(probe))
    try:
        await _until(lambda: probe.outcomes and next(iter(probe.outcomes.values())).arrivals, 60)
        sent = time.perf_counter()
        for job in crowd:
            job.stop = release
        crowd_tasks = [asyncio.create_task(client.run(job)) for job in crowd]
        all_waiting, samples = None, []
        while not probe_task.done():
            gauges = await asyncio.to_thread(ctx.server.gauges, PROBE)
            samples.append(gauges.waiting)
            if all_waiting is None and gauges.waiting >= size:
                all_waiting = time.perf_counter()
            await asyncio.sleep(0.1)
        await probe_task
        release.set()  # the client cancels the whole crowd
        await asyncio.gather(*crowd_tasks)
        return all_waiting, (all_waiting or time.perf_counter()) - sent, samples
    finally:
        release.set()
        await client.close()


def probe_phase(ctx: PhaseContext, waiting: int, probe_tokens: int, max_model_len: int) -> PhaseResult:
    prompt = "Once upon a time"
    probe_request = greedy_request(prompt, probe_tokens, forced=True)
    expected = ctx.reference.texts([probe_request], max_model_len)[0]
    crowd_requests = mixed_requests(waiting, ctx.rng, max_new=4)
    crowd = [StreamJob([encode_request(PROBE, f"crowd-{i}", r.tensors())
                        for i, r in enumerate(crowd_requests[start:start + CROWD_PER_STREAM], start)])
             for start in range(0, waiting, CROWD_PER_STREAM)]  # encoded up front
    result = PhaseResult("probe", waiting + 2)
    started = time.perf_counter()

    async def alone() -> StreamJob:
        client = SoakClient(ctx.server.grpc_url)
        try:
            return await client.run(StreamJob([encode_request(PROBE, "idle", probe_request.tensors())]))
        finally:
            await client.close()

    idle = asyncio.run(alone()).outcomes["idle"]
    loaded_job = StreamJob([encode_request(PROBE, "loaded", probe_request.tensors())])
    all_waiting, ramp_s, samples = asyncio.run(_loaded_run(ctx, loaded_job, crowd, waiting))
    loaded = loaded_job.outcomes["loaded"]
    result.seconds = time.perf_counter() - started
    compare_outputs(result, [idle, loaded], [expected, expected])
    crowd_errors = [o.error for job in crowd for o in job.outcomes.values() if o.error] + \
        [e for job in crowd for e in job.unattributed_errors]
    result.errors += len(crowd_errors)
    result.check(not crowd_errors, f"{len(crowd_errors)} waiting requests failed: {crowd_errors[:2]}")
    idle_gaps = idle.inter_token_latencies()
    loaded_gaps = _gaps_after(loaded, all_waiting)
    result.itl_p50_ms, result.itl_p99_ms = percentile_ms(loaded_gaps, 50), percentile_ms(loaded_gaps, 99)
    idle_p50, idle_p99 = percentile_ms(idle_gaps, 50), percentile_ms(idle_gaps, 99)
    # Responses often arrive in bursts (two per read), which makes the median gap tiny; the
    # mean gap is the token rate the client sees.
    idle_mean, loaded_mean = _mean_ms(idle_gaps), _mean_ms(loaded_gaps)
    result.figures.update(peak_waiting=max(samples, default=0), loaded_gaps=len(loaded_gaps),
                          itl_mean_ratio=loaded_mean / idle_mean)
    result.notes += [
        (f"crowd of {waiting} all WAITING {ramp_s:.1f} s after it was sent" if all_waiting
         else f"crowd of {waiting} never all WAITING while the probe ran")
        + f"; peak waiting gauge {max(samples, default=0):g}",
        f"probe ITL idle p50 {idle_p50:.2f} / p99 {idle_p99:.2f} ms; with {waiting} waiting "
        f"p50 {result.itl_p50_ms:.2f} / p99 {result.itl_p99_ms:.2f} ms over {len(loaded_gaps)} gaps; "
        f"ratio p50 x{result.itl_p50_ms / idle_p50:.2f}, p99 x{result.itl_p99_ms / idle_p99:.2f}",
        f"probe mean ITL idle {idle_mean:.2f} ms, with {waiting} waiting {loaded_mean:.2f} ms: "
        f"ratio x{loaded_mean / idle_mean:.2f}"]
    result.check(all_waiting is not None,
                 f"the probe finished before all {waiting} were waiting (peak {max(samples, default=0):g}); "
                 "raise --probe-tokens")
    result.check(len(loaded_gaps) >= MIN_LOADED_GAPS,
                 f"only {len(loaded_gaps)} probe tokens arrived with the whole crowd waiting")
    drain(ctx, PROBE, result)
    return result


def _mean_ms(gaps: list[float]) -> float:
    return sum(gaps) / len(gaps) * 1000.0 if gaps else float("nan")


def _gaps_after(outcome: Outcome, start: float | None) -> list[float]:
    if start is None:
        return []
    times = [t for t in outcome.arrivals if t >= start]
    return [b - a for a, b in zip(times, times[1:])]

