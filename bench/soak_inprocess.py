"""The timed soak's load on an in-process LLMEngine (issue 28, RSS growth): the same
engine arguments and request mix as bench/soak_timed.py without tritonserver, so the
process's growth can be watched closely and fast.

  python -m bench.soak_inprocess --minutes 8 [--mix soak|wide] [--streams 16]
                                 [--every 10] [--trim] [--tracemalloc]

The engine runs on its own thread, as in the backend (so its allocations land in a
non-main glibc arena, as served). Every `--every` s: RssAnon, glibc's in-use / freed-but-
kept / mmap'd bytes, the engine's per-request tables and the distinct step sizes seen;
at the end the RssAnon slope after warm-up (MiB per 10 min), the intervals where RssAnon
rose by >= 1 MiB beside what was new in them, and Python objects by type (gc) and, with
--tracemalloc, Python heap growth by line since warm-up. --trim calls malloc_trim(0)
after each sample (what the arenas keep that no allocation uses then goes back)."""
from __future__ import annotations

import argparse
import collections
import gc
import random
import sys
import threading
import time
import tracemalloc
from dataclasses import dataclass, field

from bench.malloc_stats import MIB, malloc_stats, malloc_trim, rss_anon_bytes
from bench.soak_requests import STARTERS, WORDS, mixed_requests
from bench.soak_rss import slope_mib_per_10min
from bench.soak_server import DEFAULT_ARGS


@dataclass(slots=True)
class Sample:
    t: float
    rss_anon: int
    in_use: int
    free_kept: int
    mmapped: int
    requests: int
    step_sizes: int  # distinct total scheduled tokens per step so far
    buckets: int  # distinct oneDNN row buckets (kernels/cpu/onednn.padded_rows) of those
    tables: dict[str, int]


@dataclass(slots=True)
class Load:
    rng: random.Random
    mix: str
    streams: int
    cancel_fraction: float
    started: int = 0
    finished: int = 0
    aborted: int = 0
    step_sizes: set[int] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def request(self):
        from engine import SamplingParams
        from engine.sampling_params import RequestOutputKind

        if self.mix == "soak":
            good = mixed_requests(1, self.rng)[0]
            params = SamplingParams(**good.sampling)
            prompt = good.prompt
        else:  # wider: long prompts, n > 1, logprobs, stop strings, seeded sampling
            words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(12, 480)))
            prompt = f"{self.rng.choice(STARTERS)} {words}"
            extra = {}
            roll = self.rng.random()
            if roll < 0.1:
                extra["n"] = 2
            elif roll < 0.2:
                extra["logprobs"] = 2
            elif roll < 0.3:
                extra["stop"] = ["river", "\n\n"]
            if self.rng.random() < 0.2:
                extra.update(temperature=0.8, seed=self.rng.randint(0, 1 << 30))
            else:
                extra["temperature"] = 0.0
            params = SamplingParams(max_tokens=self.rng.randint(1, 128), **extra)
        params.output_kind = RequestOutputKind.DELTA  # served streams are DELTA
        cancel_after = None
        if self.rng.random() < self.cancel_fraction:
            cancel_after = self.rng.randint(1, params.max_tokens)
        return prompt, params, cancel_after

    def run(self, engine) -> None:
        try:
            self._run(engine)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def _run(self, engine) -> None:
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            self.step_sizes.add(out.total_num_scheduled_tokens)
            return out

        engine.scheduler.schedule = recording_schedule  # a probe: counts what it returns
        active: dict[str, tuple[int | None, int]] = {}  # id -> (cancel after, tokens seen)
        while not self.stop.is_set():
            while len(active) < self.streams:
                prompt, params, cancel_after = self.request()
                self.started += 1
                request_id = f"soak-{self.started}"
                engine.add_request(request_id, prompt, params)
                active[request_id] = (cancel_after, 0)
            for out in engine.step():
                cancel_after, seen = active[out.request_id]
                seen += max(len(c.delta_token_ids) for c in out.outputs)
                if out.finished:
                    del active[out.request_id]
                    self.finished += 1
                else:
                    active[out.request_id] = (cancel_after, seen)
            due = [rid for rid, (after, seen) in active.items()
                   if after is not None and seen >= after]
            if due:
                engine.abort_request(due)
                for rid in due:
                    del active[rid]
                self.aborted += len(due)
        engine.abort_request(list(active))


def engine_tables(engine) -> dict[str, int]:
    """Sizes of what the engine keeps per request: all back to the live count when idle."""
    op, sched, state = engine.output_processor, engine.scheduler, engine.runner.sampler.state
    kv = sched.kv_cache_manager
    return {"sequences": len(op._sequences), "clients": len(op._clients),
            "scheduler": len(sched.requests), "finished_ids": len(sched.finished_req_ids),
            "kv_reqs": len(kv.req_to_blocks), "sampler": len(state.generators)
            + len(state.prompt_ids) + len(state.output_ids)}


def object_counts() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def take_sample(started: float, load: Load, engine, trim: bool) -> Sample:
    from kernels.cpu.onednn import padded_rows

    sizes = set(load.step_sizes)  # one C call: safe beside the engine thread's adds
    stats = malloc_stats()
    sample = Sample(time.monotonic() - started, rss_anon_bytes(),
                    stats.in_use if stats else 0, stats.free_kept if stats else 0,
                    stats.mmapped if stats else 0, load.finished + load.aborted,
                    len(sizes), len({padded_rows(n) for n in sizes}), engine_tables(engine))
    if trim:
        malloc_trim()
    return sample


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--warmup-minutes", type=float, default=2.0)
    ap.add_argument("--mix", choices=("soak", "wide"), default="soak")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--cancel-fraction", type=float, default=0.25)
    ap.add_argument("--every", type=float, default=10.0, metavar="S")
    ap.add_argument("--model", default=None, help="an HF folder; default the embedded SmolLM2")
    ap.add_argument("--trim", action="store_true")
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from kernels.cpu.features import detect

    load = Load(random.Random(args.seed), args.mix, args.streams, args.cancel_fraction)
    built: dict[str, object] = {}
    ready = threading.Event()

    def engine_thread() -> None:
        try:
            from engine import LLMEngine
            start = time.perf_counter()
            built["engine"] = LLMEngine(model=args.model, **DEFAULT_ARGS)
            built["seconds"] = time.perf_counter() - start
        except BaseException as exc:  # noqa: BLE001
            load.error = exc
        finally:
            ready.set()
        if load.error is None:
            load.run(built["engine"])

    thread = threading.Thread(target=engine_thread, name="llm-engine-loop")
    thread.start()
    ready.wait()
    if load.error is not None:
        raise load.error
    engine = built["engine"]
    print(f"[soak_inprocess] host ISA: {detect().describe()}; mix={args.mix}, "
          f"{args.streams} streams, {args.minutes:g} min, trim={args.trim}; engine built "
          f"(load + warm-up) in {built['seconds']:.1f} s", flush=True)
    started = time.monotonic()
    warmup_s = min(args.warmup_minutes * 60, args.minutes * 20)
    samples = [take_sample(started, load, engine, args.trim)]
    objects_at_warmup = None
    snapshot_at_warmup = None
    # The gc pass's list of every object is freed into glibc's arenas and kept: +3-4 MiB
    # RssAnon at the next sample, the bench's own; the slope is fitted after it.
    fit_after = warmup_s
    deadline = started + args.minutes * 60
    while time.monotonic() < deadline and load.error is None and thread.is_alive():
        time.sleep(args.every)
        samples.append(take_sample(started, load, engine, args.trim))
        if objects_at_warmup is None and samples[-1].t >= warmup_s:
            objects_at_warmup = object_counts()
            fit_after = time.monotonic() - started
            if args.tracemalloc:
                tracemalloc.start(8)
                snapshot_at_warmup = tracemalloc.take_snapshot()
    load.stop.set()
    thread.join()
    if load.error is not None:
        raise load.error
    end = take_sample(started, load, engine, False)
    samples.append(end)
    print(format_report(samples, fit_after, load), flush=True)
    if objects_at_warmup is not None:
        grown = object_counts()
        grown.subtract(objects_at_warmup)
        top = [(k, v) for k, v in grown.most_common(8) if v > 0]
        print("objects by type, end minus warm-up (after gc): "
              + (", ".join(f"{k} +{v}" for k, v in top) or "none grew"))
    if snapshot_at_warmup is not None:
        stats = tracemalloc.take_snapshot().compare_to(snapshot_at_warmup, "lineno")
        print("Python heap since warm-up, top lines:")
        for stat in stats[:8]:
            print(f"  {stat.size_diff / 1024:+.1f} KiB {stat.count_diff:+d} blocks "
                  f"{stat.traceback[0]}")
    before = rss_anon_bytes()
    trimmed = malloc_trim()
    print(f"malloc_trim(0) at the end: returned={trimmed}, RssAnon {before / MIB:.1f} -> "
          f"{rss_anon_bytes() / MIB:.1f} MiB")
    return 0


def format_report(samples: list[Sample], fit_after: float, load: Load) -> str:
    points = [(s.t, s.rss_anon) for s in samples]
    last = samples[-1]
    lines = [f"{last.t / 60:.1f} min: {load.finished} finished, {load.aborted} aborted; "
             f"{last.step_sizes} distinct step sizes in {last.buckets} oneDNN row buckets",
             f"RssAnon {samples[0].rss_anon / MIB:.1f} -> {last.rss_anon / MIB:.1f} MiB; slope "
             f"after {fit_after / 60:.1f} min (warm-up, then the gc snapshot): "
             f"{slope_mib_per_10min(points, fit_after):+.3f} MiB / 10 min",
             f"glibc at the end: in use {last.in_use / MIB:.1f} MiB, freed but kept "
             f"{last.free_kept / MIB:.1f} MiB, mmap'd {last.mmapped / MIB:.1f} MiB",
             f"per-request tables at the end (idle): {last.tables}"]
    for before, after in zip(samples, samples[1:]):
        grew = after.rss_anon - before.rss_anon
        malloc_grew = sum(getattr(after, f) - getattr(before, f)
                          for f in ("in_use", "free_kept", "mmapped"))
        if abs(grew) >= MIB:
            lines.append(
                f"  {before.t:6.0f}-{after.t:4.0f} s: RssAnon {grew / MIB:+.1f} MiB, in use "
                f"{(after.in_use - before.in_use) / MIB:+.1f}, kept "
                f"{(after.free_kept - before.free_kept) / MIB:+.1f}, mmap'd "
                f"{(after.mmapped - before.mmapped) / MIB:+.1f}, outside malloc "
                f"{(grew - malloc_grew) / MIB:+.1f}; new step sizes "
                f"{after.step_sizes - before.step_sizes}, new buckets "
                f"{after.buckets - before.buckets}, requests "
                f"{after.requests - before.requests}")
    lines.append("RssAnon MiB: " + " ".join(f"{s.rss_anon / MIB:.0f}" for s in samples))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
