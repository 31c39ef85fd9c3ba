"""Soak and overload figures of the served `llm` model (issue 10: one request can never
hurt another), against a real tritonserver started here.

  python -m bench.soak [--model tiny|default] [--streams 1000] [--phase all|load|cancel|bad|overload|probe]

- load: N concurrent gRPC streams of mixed lengths; every output must equal the same
  greedy request run by the in-process engine with the same arguments.
- cancel: N streams, half cancelled by the client at random moments.
- bad: every kind of bad request, interleaved with good ones.
- overload: bursts of 10 x MAX_QUEUE_LEN at once on a copy with a small queue: the excess
  is refused at once and counted, the rest finish, the server's memory stays flat from one
  burst to the next (six warm-up bursts, then three measured).
- probe: one stream's inter-token latency while thousands wait, against idle.
Each phase must end with no KV in use and no request running or waiting, the server ready.
Exits 1 when a correctness check fails. The tiny model (random weights, fp32) keeps the
whole run to minutes on 2 cores; `--model default` serves the embedded SmolLM2.
"""
from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.soak_overload import overload_phase
from bench.soak_phases import PhaseContext, PhaseResult, bad_phase, cancel_phase, load_phase
from bench.soak_probe import probe_phase
from bench.soak_requests import Reference
from bench.soak_server import (DEFAULT_ARGS, MAIN, PROBE, SMALL_QUEUE, TINY_ARGS, ModelSpec, ServerPlan,
                               SoakServer)

PHASES = ("load", "cancel", "bad", "overload", "probe")
_PHASE_MODEL = {"load": MAIN, "cancel": MAIN, "bad": MAIN, "overload": SMALL_QUEUE, "probe": PROBE}


@dataclass(slots=True)
class SoakConfig:
    model: str = "tiny"  # "tiny" | "default"
    streams: int = 1000
    phases: tuple[str, ...] = PHASES
    bad_rounds: int = 0  # 0: one round of every bad kind per 100 streams
    overload_queue_len: int = 64
    overload_rss_floor_mib: float = 8.0  # RSS growth per burst always allowed (noise)
    overload_warm_bursts: int = 6  # unmeasured: the bucketed matmuls get compiled in these
    probe_waiting: int = 5000
    probe_tokens: int = 0  # 0: as long as the probe model allows
    seed: int = 0


@dataclass(slots=True)
class SoakSummary:
    isa: str
    model: str
    server_ready_s: float
    phases: list[PhaseResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.phases)


def _model_spec(label: str, work: Path) -> ModelSpec:
    if label == "default":
        return ModelSpec("default", "", dict(DEFAULT_ARGS))
    from testing.tiny_model import make_tiny_model_dir
    return ModelSpec("tiny", str(make_tiny_model_dir(work / "tiny-llama")), dict(TINY_ARGS))


def run_soak(config: SoakConfig) -> SoakSummary:
    with tempfile.TemporaryDirectory(prefix="soak-model-") as work:
        return _run_with_model(config, _model_spec(config.model, Path(work)))


def _run_with_model(config: SoakConfig, spec: ModelSpec) -> SoakSummary:
    from kernels.cpu.features import detect

    max_model_len = int(spec.engine_args["max_model_len"])
    # The probe model gets the longest context the tiny model's positions allow, so the
    # probe outlasts the crowd's arrival; SmolLM2 is slow enough at its usual length.
    probe_len = 2048 if spec.label == "tiny" else max_model_len
    plan = ServerPlan(spec, main_queue_len=max(1024, 2 * config.streams),
                      overload_queue_len=config.overload_queue_len,
                      probe_queue_len=config.probe_waiting + 64, probe_max_model_len=probe_len,
                      models=sorted({_PHASE_MODEL[p] for p in config.phases}))
    reference = Reference(spec.path or None, spec.engine_args)
    rng = random.Random(config.seed)
    with SoakServer(plan) as server:
        summary = SoakSummary(detect().describe(), spec.label, server.ready_s)
        ctx = PhaseContext(server, reference, rng, max_model_len)
        runners = {
            "load": lambda: load_phase(ctx, config.streams),
            "cancel": lambda: cancel_phase(ctx, config.streams),
            "bad": lambda: bad_phase(ctx, config.bad_rounds or max(1, config.streams // 100),
                                     max(8, config.streams // 2)),
            "overload": lambda: overload_phase(ctx, config.overload_queue_len,
                                               config.overload_rss_floor_mib,
                                               warm_bursts=config.overload_warm_bursts),
            "probe": lambda: probe_phase(ctx, config.probe_waiting,
                                         config.probe_tokens or probe_len - 64, probe_len),
        }
        for phase in config.phases:
            started = time.perf_counter()
            print(f"[soak] {phase} ...", flush=True)
            result = runners[phase]()
            print(f"[soak] {phase} done in {time.perf_counter() - started:.1f} s"
                  + ("" if not result.failures else f": {len(result.failures)} failed checks"), flush=True)
            summary.phases.append(result)
    if summary.ok:
        shutil.rmtree(server.work, ignore_errors=True)
    else:
        print(f"[soak] server log: {server.log_path}", flush=True)
    return summary


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def format_summary(summary: SoakSummary) -> str:
    lines = [f"host ISA: {summary.isa}; model: {summary.model}; server ready in {summary.server_ready_s:.1f} s",
             f"{'phase':<9}{'requests':>9}{'errors':>8}{'mismatch':>9}{'leaked KV':>10}"
             f"{'ITL p50 ms':>11}{'ITL p99 ms':>11}{'time s':>8}  result"]
    for p in summary.phases:
        lines.append(f"{p.phase:<9}{p.requests:>9}{p.errors:>8}{p.mismatches:>9}{p.leaked_kv:>10g}"
                     f"{_ms(p.itl_p50_ms):>11}{_ms(p.itl_p99_ms):>11}{p.seconds:>8.1f}  "
                     + ("ok" if p.ok else "FAIL"))
    for p in summary.phases:
        lines += [f"  {p.phase}: {note}" for note in p.notes]
        lines += [f"  {p.phase}: FAILED {failure}" for failure in p.failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "default"], default="tiny")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--phase", choices=["all", *PHASES], default="all")
    ap.add_argument("--overload-queue-len", type=int, default=64)
    ap.add_argument("--probe-waiting", type=int, default=5000)
    ap.add_argument("--probe-tokens", type=int, default=0, help="0: the probe model's length - 64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    config = SoakConfig(model=args.model, streams=args.streams,
                        phases=PHASES if args.phase == "all" else (args.phase,),
                        overload_queue_len=args.overload_queue_len, probe_waiting=args.probe_waiting,
                        probe_tokens=args.probe_tokens, seed=args.seed)
    summary = run_soak(config)
    print(format_summary(summary))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
