"""One-shot GPU check for a lent GPU machine, runnable there as it is:

  python3 bench/bench_gpu.py            (or python3 -m bench.bench_gpu, from the repo root)
  python3 -m bench.bench_gpu --rehearse (the same flow on CPU under TRITON_INTERPRET=1)

Needs only the tree and the machine's own torch, triton and transformers: the models are
random-weight Llamas built on the spot (bench/gpu_models.py), never downloaded. In order:
1. kernels: each Triton kernel against fp32 attention on the host (bf16, fp16, head_dim 8,
   dispatch, KV writes);
2. engine greedy agreement, device vs CPU, on a SmolLM2-135M-shaped model in fp32 and
   bf16 (child process), with the logit margin at any divergence;
3. decode attention bandwidth at batch 64, contexts 8k and 32k, as a share of the peak;
4. end-to-end tokens/s of a 1B Llama at batch 1 and 64 against HF `generate` and the
   weights-per-token roofline (child process);
5. the risky cases last: fp32 tiles, int64 block tables, a KV cache past 2^31 elements,
   a second GPU.
Every case is isolated (own try, synchronize) and every FAIL makes the exit status 1 (2:
no CUDA device). Sized to stay under ~8 minutes on an H200 (an estimate until a first
run); --cases reruns a subset by name. Progress lines carry seconds since the start.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CHILD_JOBS = ("greedy", "throughput")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true",
                        help="CPU rehearsal under TRITON_INTERPRET=1 with small shapes")
    parser.add_argument("--cases", nargs="+", metavar="TEXT",
                        help="run only the cases whose name contains one of these")
    parser.add_argument("--peak-tbps", type=float,
                        help="device peak memory bandwidth (default: from the device name)")
    parser.add_argument("--workdir", help="where model folders go (default: a temporary "
                        "folder, removed at the end; never $OUT, whose files travel back)")
    parser.add_argument("--summary-out", help="also write the summary table to this file")
    parser.add_argument("--child", choices=CHILD_JOBS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--origin", type=float, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rehearse:
        # Must precede the first import of triton, which torch may trigger.
        os.environ["TRITON_INTERPRET"] = "1"
    if str(REPO_ROOT) not in sys.path:  # run as a file, sys.path[0] is bench/
        sys.path.insert(0, str(REPO_ROOT))
    import torch
    if not args.rehearse and not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (--rehearse runs the CPU rehearsal)")
        return 2
    device = "cpu" if args.rehearse else "cuda"
    keep = Path(args.workdir) if args.workdir else None
    workdir = keep or Path(tempfile.mkdtemp(prefix="bench_gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if args.child:
            return run_child(args, device, workdir)
        return run_all(args, device, workdir)
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


def selected(name: str, patterns: list[str] | None) -> bool:
    return not patterns or any(p in name for p in patterns)


def run_child(args: argparse.Namespace, device: str, workdir: Path) -> int:
    from bench.gpu_engine_cases import EngineSettings, GreedyJob, ThroughputJob
    from bench.gpu_report import CaseRunner, json_recorder
    settings = EngineSettings(device, args.rehearse, workdir)
    runner = CaseRunner(device, on_result=json_recorder(Path(args.child_out)),
                        origin=args.origin, prefix=f"  {args.child}: ")
    job = (GreedyJob(settings, runner.log) if args.child == "greedy"
           else ThroughputJob(settings, args.peak_tbps * 1e12, runner.log))
    for case in job.cases():
        if selected(case.name, args.cases):
            runner.run_case(case)
    return runner.exit_code()


def describe_device(device: str, peak_override: float | None) -> tuple[str, float]:
    import torch
    if device == "cpu":
        from bench.gpu_bandwidth import REHEARSAL_PEAK_TBPS
        return f"CPU rehearsal ({platform.processor() or platform.machine()})", (
            peak_override or REHEARSAL_PEAK_TBPS)
    from bench.gpu_bandwidth import peak_tbps
    name = torch.cuda.get_device_name()
    peak, known = peak_tbps(name)
    if peak_override:
        peak, known = peak_override, True
    note = "" if known else " (unknown device: assumed)"
    props = torch.cuda.get_device_properties(0)
    return (f"{name} x{torch.cuda.device_count()} (sm_{props.major}{props.minor}, "
            f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), "
            f"peak {peak} TB/s{note}", peak)


def build_plan(device: str, rehearse: bool, peak_bytes_per_s: float) -> list:
    """Cases and child jobs in run order: safe kernel cases, engine agreement, bandwidth,
    throughput, then the risky cases that may fault or fail to compile."""
    from bench.gpu_bandwidth import bandwidth_cases
    from bench.gpu_engine_cases import (GREEDY_RUNS, THROUGHPUT_BATCHES, greedy_case_name,
                                        throughput_case_name)
    from bench.gpu_kernel_cases import safe_cases
    from bench.gpu_report import ChildJob
    from bench.gpu_risky_cases import risky_cases
    greedy = ChildJob("greedy", tuple(greedy_case_name(t) for t in GREEDY_RUNS), 300)
    throughput = ChildJob("throughput",
                          tuple(throughput_case_name(b) for b in THROUGHPUT_BATCHES), 240)
    return [*safe_cases(device, rehearse), greedy,
            *bandwidth_cases(device, peak_bytes_per_s, rehearse), throughput,
            *risky_cases(device, rehearse)]


def step_names(plan: list) -> list[str]:
    from bench.gpu_report import ChildJob
    names: list[str] = []
    for step in plan:
        names.extend(step.names if isinstance(step, ChildJob) else [step.name])
    return names


def run_all(args: argparse.Namespace, device: str, workdir: Path) -> int:
    import torch
    import triton

    from bench.gpu_report import CaseRunner, ChildJob
    from bench.gpu_risky_cases import enforce_gpu_dot_shapes

    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = "missing"
    described, peak = describe_device(device, args.peak_tbps)
    runner = CaseRunner(device)
    runner.log(f"{described}; python {platform.python_version()}, torch {torch.__version__}, "
               f"triton {triton.__version__}, transformers {hf_version}")
    if args.rehearse:
        runner.log(enforce_gpu_dot_shapes())
    for step in build_plan(device, args.rehearse, peak * 1e12):
        if isinstance(step, ChildJob):
            names = tuple(n for n in step.names if selected(n, args.cases))
            if names:
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()  # the child needs the memory, not our cache
                run_child_job(runner, ChildJob(step.job, names, step.timeout_s), args,
                              workdir, peak)
        elif selected(step.name, args.cases):
            runner.run_case(step)
    table = runner.summary()
    print("\n" + table, flush=True)
    if args.summary_out:
        Path(args.summary_out).write_text(table + "\n")
    return runner.exit_code()


def run_child_job(runner, job, args: argparse.Namespace, workdir: Path, peak: float) -> None:
    out_path = workdir / f"child-{job.job}.json"
    command = [sys.executable, "-m", "bench.bench_gpu", "--child", job.job,
               "--child-out", str(out_path), "--workdir", str(workdir), "--peak-tbps", str(peak),
               "--origin", repr(runner.origin), "--cases", *job.names]
    if args.rehearse:
        command.append("--rehearse")
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    runner.run_child(job, command, out_path, env=env, cwd=str(REPO_ROOT))


if __name__ == "__main__":
    sys.exit(main())
