"""A timed soak of the served `llm` (issue 28, item 5): mixed streaming load with client
cancels for `--minutes`, the python backend stub's RSS sampled every 30 s, then a drain
and a sample of the served outputs checked against the same requests run alone.

  python -m bench.soak_timed --minutes 30 [--dtype auto] [--streams 16]
                             [--engine-arg batch_invariant=true ...]

Prints the host ISA, requests served / cancelled, errors, leaked KV blocks, the stub's RSS
slope after warm-up (MiB per 10 minutes, least squares) and the sample's mismatch rate.
Exits 1 on an error, a leak or a server that is not ready after; the RSS slope and the
mismatch rate are figures to read, not checks (greedy fp32 batched vs alone may differ)."""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from bench.soak_client import CancelPlan, SoakClient, StreamJob, encode_request
from bench.soak_phases import single_job
from bench.soak_requests import GoodRequest, mixed_requests
from bench.soak_rss import RssSampler, slope_mib_per_10min
from bench.soak_server import DEFAULT_ARGS, MAIN, ModelSpec, ServerPlan, SoakServer

MIB = 1024 * 1024


@dataclass(slots=True)
class TimedConfig:
    minutes: float = 30.0
    dtype: str = "auto"
    streams: int = 16  # concurrent streams, each one request after another
    cancel_fraction: float = 0.25
    max_new: int = 64
    sample: int = 24  # finished requests re-run alone at the end
    rss_every_s: float = 30.0
    warmup_minutes: float = 5.0  # capped at a third of the run
    engine_args: dict[str, str] = field(default_factory=dict)
    seed: int = 0


@dataclass(slots=True)
class TimedResult:
    isa: str
    config: TimedConfig
    seconds: float = 0.0
    served: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    leaked_blocks: float = 0.0
    ready_after: bool = False
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)
    anon: list[tuple[float, int]] = field(default_factory=list)  # RssAnon
    sampled: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def warmup_s(self) -> float:
        return min(self.config.warmup_minutes * 60, self.seconds / 3)

    @property
    def ok(self) -> bool:
        return not self.errors and self.leaked_blocks == 0 and self.ready_after


@dataclass(slots=True)
class _Load:
    rng: random.Random
    config: TimedConfig
    result: TimedResult
    finished: list[tuple[GoodRequest, str]] = field(default_factory=list)
    count: int = 0

    async def worker(self, client: SoakClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            good = mixed_requests(1, self.rng, self.config.max_new)[0]
            plan = None
            if self.rng.random() < self.config.cancel_fraction:
                plan = CancelPlan(self.rng.randint(1, good.sampling["max_tokens"]))
            self.count += 1
            request_id = f"timed-{self.count}"
            job = await client.run(single_job(MAIN, request_id, good, plan), timeout=300)
            outcome = job.outcomes[request_id]
            if outcome.cancelled:
                self.result.cancelled += 1
            elif outcome.error is not None or not outcome.final:
                self.result.errors.append(f"{request_id}: {outcome.error or 'no final response'}")
            else:
                self.result.served += 1
                self.finished.append((good, outcome.text))


async def _run_load(url: str, load: _Load, seconds: float) -> None:
    client = SoakClient(url)
    deadline = time.monotonic() + seconds
    try:
        await asyncio.gather(*(load.worker(client, deadline) for _ in range(load.config.streams)))
    finally:
        await client.close()


async def _alone(url: str, sample: list[tuple[GoodRequest, str]], result: TimedResult) -> None:
    client = SoakClient(url)
    try:
        for index, (good, served) in enumerate(sample):
            request_id = f"alone-{index}"
            job = StreamJob([encode_request(MAIN, request_id, good.tensors())])
            outcome = (await client.run(job, timeout=300)).outcomes[request_id]
            result.sampled += 1
            if outcome.error is not None:
                result.errors.append(f"{request_id} (alone): {outcome.error}")
            elif outcome.text != served:
                result.mismatches.append(f"{good.prompt[:30]!r} {good.sampling_json}: under load "
                                         f"{served[:40]!r}, alone {outcome.text[:40]!r}")
    finally:
        await client.close()


def run_timed(config: TimedConfig) -> TimedResult:
    from kernels.cpu.features import detect

    args = {**DEFAULT_ARGS, "dtype": config.dtype, **config.engine_args}
    plan = ServerPlan(ModelSpec("default", "", args), main_queue_len=1024, overload_queue_len=64,
                      probe_queue_len=64, probe_max_model_len=int(args["max_model_len"]),
                      models=[MAIN])
    result = TimedResult(detect().describe(), config)
    load = _Load(random.Random(config.seed), config, result)
    with SoakServer(plan) as server:
        print(f"[soak_timed] server ready in {server.ready_s:.1f} s; {config.minutes:g} min of "
              f"{config.streams} streams", flush=True)
        sampler = RssSampler(server.handle.process.pid, config.rss_every_s)
        started = time.monotonic()
        with sampler:
            asyncio.run(_run_load(server.grpc_url, load, config.minutes * 60))
        result.seconds = time.monotonic() - started
        result.rss, result.anon = sampler.samples, sampler.anon
        gauges, _ = server.wait_until(MAIN, lambda g: g.idle, 60)
        result.leaked_blocks = gauges.kv_usage * int(args["num_kv_blocks"])
        if not gauges.idle:
            result.errors.append(f"not idle 60 s after the load: {gauges}")
        sample = load.rng.sample(load.finished, min(config.sample, len(load.finished)))
        asyncio.run(_alone(server.grpc_url, sample, result))
        result.ready_after = server.alive()
    return result


def format_timed(result: TimedResult) -> str:
    c = result.config
    extra = " ".join(f"{k}={v}" for k, v in sorted(c.engine_args.items())) or "-"
    lines = [f"host ISA: {result.isa}; SmolLM2-135M dtype={c.dtype}; engine args: {extra}",
             f"{result.seconds / 60:.1f} min, {c.streams} streams: {result.served} served, "
             f"{result.cancelled} cancelled by the client, {len(result.errors)} errors, "
             f"leaked KV blocks {result.leaked_blocks:g}, ready after: {result.ready_after}"]
    for label, samples in (("RSS", result.rss), ("RssAnon", result.anon)):
        if not samples:
            continue
        first, last = samples[0][1] / MIB, samples[-1][1] / MIB
        slope = slope_mib_per_10min(samples, result.warmup_s)
        lines.append(f"stub {label}: {len(samples)} samples, {first:.1f} -> {last:.1f} MiB; slope "
                     f"after {result.warmup_s / 60:.1f} min warm-up: {slope:+.3f} MiB / 10 min")
        lines.append(f"  {label} MiB every {c.rss_every_s:g} s: "
                     + " ".join(f"{b / MIB:.0f}" for _, b in samples))
    rate = len(result.mismatches) / result.sampled if result.sampled else float("nan")
    lines.append(f"alone-run sample: {result.sampled} requests, {len(result.mismatches)} "
                 f"differ (mismatch rate {rate:.3f})")
    lines += [f"  mismatch: {m}" for m in result.mismatches[:5]]
    lines += [f"  error: {e}"[:300] for e in result.errors[:5]]
    return "\n".join(lines)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--cancel-fraction", type=float, default=0.25)
    ap.add_argument("--sample", type=int, default=24)
    ap.add_argument("--rss-every", type=float, default=30.0, metavar="S")
    ap.add_argument("--engine-arg", action="append", default=[], type=_key_value,
                    metavar="KEY=VALUE", help="passed to the served model's config.pbtxt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    config = TimedConfig(minutes=args.minutes, dtype=args.dtype, streams=args.streams,
                         cancel_fraction=args.cancel_fraction, sample=args.sample,
                         rss_every_s=args.rss_every, engine_args=dict(args.engine_arg),
                         seed=args.seed)
    result = run_timed(config)
    print(format_timed(result), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
