"""Overload: bursts of 10 x MAX_QUEUE_LEN requests at once on the copy with a small queue.

The excess must be refused ('server busy', UNAVAILABLE) without waiting for the queue,
counted in vllm:admission_rejections_total, the rest served unchanged, and the server's
memory must not grow from one burst to the next. Unmeasured warm-up bursts settle what is
allocated once: gRPC buffers, Python arenas, and oneDNN's compiled matmuls, one per
weight shape and row-count bucket (kernels/cpu/onednn.padded_rows), which a server
builds over its first bursts as it meets new batch sizes. The figures come from the
bursts after them."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from bench.soak_client import Outcome, percentile_ms
from bench.soak_phases import (DRAIN_TIMEOUT_S, PhaseContext, PhaseResult, compare_outputs, drain,
                               record_itl, run_jobs, single_job)
from bench.soak_requests import GoodRequest, greedy_request, mixed_requests
from bench.soak_server import REJECTED, SMALL_QUEUE

MEASURED_BURSTS = 3
# Memory "flat": what a burst may leave behind. RSS moves by a few MiB between identical
# idle moments (arenas, lazily freed pages), hence a floor (SoakConfig.overload_rss_floor_mib).
GROWTH_PER_REQUEST_BYTES = 16 * 2**10


@dataclass(slots=True)
class Burst:
    outcomes: list[Outcome]
    started: float
    seconds: float

    def refused(self) -> list[int]:
        return [i for i, o in enumerate(self.outcomes) if o.error is not None and "server busy" in o.error]


def _burst(ctx: PhaseContext, goods: list[GoodRequest], tag: str) -> Burst:
    jobs = [single_job(SMALL_QUEUE, f"{tag}-{i}", g) for i, g in enumerate(goods)]  # encoded up front
    started = time.perf_counter()
    jobs = asyncio.run(run_jobs(ctx.server.grpc_url, jobs))
    seconds = time.perf_counter() - started
    ctx.server.wait_until(SMALL_QUEUE, lambda g: g.idle, DRAIN_TIMEOUT_S)
    return Burst([job.outcomes[f"{tag}-{i}"] for i, job in enumerate(jobs)], started, seconds)


def overload_phase(ctx: PhaseContext, queue_len: int, growth_floor_mib: float,
                   forced_tokens: int = 64, warm_bursts: int = 6) -> PhaseResult:
    server = ctx.server
    total = 10 * queue_len
    goods = [greedy_request(g.prompt, forced_tokens, forced=True) for g in mixed_requests(total, ctx.rng)]
    expected = ctx.reference.texts(goods)
    rss_cold = server.group_rss_bytes()
    for n in range(warm_bursts):
        _burst(ctx, goods, f"warm{n}")
    rss = [server.group_rss_bytes()]
    result = PhaseResult("overload", total * MEASURED_BURSTS)
    served_all, waits, late, example = [], [], [], ""
    for n in range(MEASURED_BURSTS):
        rejected_before = server.rejected(SMALL_QUEUE)
        burst = _burst(ctx, goods, f"over{n}")
        rss.append(server.group_rss_bytes())
        result.seconds += burst.seconds
        busy = burst.refused()
        refused = set(busy)
        served = [i for i in range(total) if i not in refused]
        compare_outputs(result, [burst.outcomes[i] for i in served], [expected[i] for i in served])
        served_all += [burst.outcomes[i] for i in served]
        example = burst.outcomes[busy[0]].error if busy else example
        waits += [burst.outcomes[i].error_at - burst.outcomes[i].sent_at for i in busy]
        # A refusal that waited for the queue would come after the queued requests finish,
        # i.e. after the first half of the served (the running batch).
        last_refusal = max((burst.outcomes[i].error_at for i in busy), default=burst.started)
        done = sorted(burst.outcomes[i].arrivals[-1] for i in served if burst.outcomes[i].arrivals)
        median_done = done[len(done) // 2] if done else float("inf")
        late.append((last_refusal - burst.started, median_done - burst.started))
        rejected = server.wait_rejected(SMALL_QUEUE, rejected_before + len(busy)) - rejected_before
        result.check(rejected == len(busy), f"burst {n}: rejected counter +{rejected:g} != {len(busy)} refused")
        # Accepted: the queue, the running batch (as large as the queue here), and whatever
        # finished while the burst was still arriving.
        result.check(len(busy) >= total - 3 * queue_len, f"burst {n}: only {len(busy)} of {total} refused")
        result.check(last_refusal < median_done, f"burst {n}: the last refusal came {late[-1][0]:.2f} s in, "
                     f"after half the served were done ({late[-1][1]:.2f} s)")
        result.figures["refused"] = result.figures.get("refused", 0) + len(busy)
        result.figures["rejected_counter"] = result.figures.get("rejected_counter", 0) + rejected
    record_itl(result, served_all)
    growth = (rss[-1] - rss[0]) / MEASURED_BURSTS
    allowed = max(growth_floor_mib * 2**20, GROWTH_PER_REQUEST_BYTES * total)
    result.figures.update(served=len(served_all), refusal_max_ms=percentile_ms(waits, 100),
                          rss_growth_per_burst=growth)
    result.notes += [
        f"{MEASURED_BURSTS} bursts of {total}: {len(served_all)} served, {result.figures['refused']:g} refused "
        f"'server busy'; time to refusal p50 {percentile_ms(waits, 50):.0f} ms, max "
        f"{percentile_ms(waits, 100):.0f} ms; last refusal / half the served done at "
        + ", ".join(f"{a:.2f} / {b:.2f} s" for a, b in late),
        f"{REJECTED} +{result.figures['rejected_counter']:g}" + (f"; {example!r}" if example else ""),
        f"server RSS (tritonserver + stubs) {rss_cold / 2**20:.0f} MiB cold, after each burst "
        + " -> ".join(f"{r / 2**20:.0f}" for r in rss) + f" MiB: {growth / 2**20:+.1f} MiB per burst"]
    result.check(growth < allowed, f"server RSS grew {growth / 2**20:.1f} MiB per burst of {total} "
                 f"(allowed {allowed / 2**20:.0f})")
    drain(ctx, SMALL_QUEUE, result)
    return result
