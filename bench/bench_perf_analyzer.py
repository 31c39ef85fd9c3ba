"""Output tokens/s streamed through Triton, driven by Triton's C++ perf_analyzer, vs
in-process LLM.generate on the same 64-request workload, in one run; beside them the
same load on `stream_ceiling` (bench/stream_ceiling), a decoupled Python model with no
engine, which shows what Triton's streaming path alone can carry on this host.

  python -m bench.bench_perf_analyzer [--workload fixed|variable] [--rounds 3]
        [--stream-interval N] [--set NAME=VALUE] [--py-spy FILE]

perf_analyzer: bash ../shared/tools/install-perf-analyzer.sh (or $PERF_ANALYZER).
The Python client of bench.bench_triton costs ~200 us a response on the cores the server
needs; perf_analyzer's C++ client is the one vllm_backend's figures come from.

What is counted. perf_analyzer runs `-m llm -i grpc --async --streaming` at concurrency
64 with --request-count 64, one request per prompt, its --input-data built from the
workload: text_input, stream, exclude_input_in_output, return_num_output_tokens and
sampling_parameters {temperature 0, max_tokens = min_tokens = n, ignore_eos}. From its
--profile-export-file: output tokens are the sum of num_output_tokens over every
response (checked against each prompt's n, each prompt sent once), the time is from the
first request sent to the last response received. In-process: the same tokens over
LLM.generate's wall time. Round r runs the sides in a rotating order on the workload of
seed r, each side's prompts led by a digit of its own (no prefix-cache hits across
sides); every round's ratio is printed, and the CPU seconds each process used.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.bench_generate import make_workload
from bench.bench_triton import REPO, InProcess
from engine.models import default_model_dir
from kernels.cpu import features as cpu_features

CEILING = Path(__file__).resolve().parent / "stream_ceiling"
CONCURRENCY = 64


def perf_analyzer_path() -> str:
    path = os.environ.get("PERF_ANALYZER") or str(Path.home() / ".cache/perf-analyzer/bin/perf_analyzer")
    if not Path(path).exists():
        raise SystemExit(f"perf_analyzer not found at {path}: "
                         "run bash ../shared/tools/install-perf-analyzer.sh or set PERF_ANALYZER")
    return path


def input_data(texts: list[str], lengths: list[int]) -> dict:
    """perf_analyzer's --input-data: one step per request, in workload order."""
    return {"data": [{
        "text_input": [text],
        "stream": [True],
        "exclude_input_in_output": [True],
        "return_num_output_tokens": [True],
        "sampling_parameters": [json.dumps({"temperature": 0, "max_tokens": n, "min_tokens": n,
                                            "ignore_eos": True})],
    } for text, n in zip(texts, lengths)]}


@dataclass(frozen=True)
class Streamed:
    """One perf_analyzer run, read from its profile export."""
    tokens: int
    responses: int
    seconds: float  # first request sent to last response received
    client_cpu_s: float  # perf_analyzer's own user + system time

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def read_export(path: Path, texts: list[str], lengths: list[int], client_cpu_s: float) -> Streamed:
    requests = [r for e in json.loads(path.read_text())["experiments"] for r in e["requests"]]
    produced: dict[str, int] = {}
    responses = 0
    for r in requests:
        text = r["request_inputs"]["text_input"]
        if text in produced:
            raise RuntimeError("perf_analyzer sent a prompt twice")
        produced[text] = sum(int(out.get("num_output_tokens", 0)) for out in r["response_outputs"])
        responses += len(r["response_timestamps"])
    if produced != dict(zip(texts, lengths)):
        raise RuntimeError("the server returned other output lengths than requested")
    start = min(r["timestamp"] for r in requests)
    end = max(r["response_timestamps"][-1] for r in requests)
    return Streamed(sum(lengths), responses, (end - start) / 1e9, client_cpu_s)


def run_perf_analyzer(grpc_url: str, model: str, texts: list[str], lengths: list[int],
                      work: Path) -> Streamed:
    (work / "input.json").write_text(json.dumps(input_data(texts, lengths)))
    export = work / "export.json"
    export.unlink(missing_ok=True)
    cmd = [perf_analyzer_path(), "-m", model, "-i", "grpc", "--async", "--streaming", "-u", grpc_url,
           "--input-data", str(work / "input.json"), "--concurrency-range", str(min(CONCURRENCY, len(texts))),
           "--request-count", str(len(texts)), "--measurement-mode", "count_windows",
           "--profile-export-file", str(export)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({done.returncode}): "
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return read_export(export, texts, lengths, cpu)


def repository(params: dict[str, str], work: Path) -> Path:
    """The shipped `llm` model (its config.pbtxt plus `params`) and `stream_ceiling`."""
    repo = work / "repo"
    shutil.copytree(REPO / "llm", repo / "llm")
    shutil.copytree(CEILING, repo / "stream_ceiling", ignore=shutil.ignore_patterns("__pycache__"))
    with open(repo / "llm" / "config.pbtxt", "a") as config:
        for key, value in params.items():
            config.write(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n')
    return repo


def process_cpu(server_pid: int) -> dict[str, float]:
    """CPU seconds so far: tritonserver itself, and each backend stub by its model."""
    import psutil

    def used(process) -> float:
        times = process.cpu_times()
        return times.user + times.system
    server = psutil.Process(server_pid)
    out = {"tritonserver": used(server)}
    for child in server.children(recursive=True):
        name = "stub llm" if any("/llm" in a for a in child.cmdline()) else "stub ceiling"
        out[name] = out.get(name, 0.0) + used(child)
    return out


def stub_pid(server_pid: int, model: str) -> int:
    import psutil
    for child in psutil.Process(server_pid).children(recursive=True):
        if any(f"/{model}" in a for a in child.cmdline()):
            return child.pid
    raise RuntimeError(f"no backend stub for {model}")


def start_py_spy(pid: int, output: str) -> subprocess.Popen:
    """py-spy (the venv's) sampling `pid` until SIGINT: collapsed stacks by thread.
    --nonblocking: the stub is never paused, so the run it samples keeps its pace."""
    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
                            "--threads", "--nonblocking", "--rate", "200", "--format", "raw",
                            "--output", output], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # to attach
    return spy


SIDES = ("in-process LLM.generate", "Triton, perf_analyzer", "stream_ceiling, perf_analyzer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["fixed", "variable"], default="fixed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="an engine argument for both sides (repeatable), e.g. num_threads=2")
    ap.add_argument("--py-spy", metavar="FILE", help="py-spy the llm stub through round 0's Triton "
                    "run, writing collapsed stacks (with thread names) to FILE")
    args = ap.parse_args()
    engine_args = dict(item.split("=", 1) for item in args.set)
    params = dict(engine_args)
    if args.stream_interval != 1:
        params["stream_interval"] = str(args.stream_interval)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    rounds = []
    for seed in range(args.rounds):
        w = make_workload(args.workload, tok, seed=seed)
        rounds.append(([tok.decode(p) for p in w.prompts], w.max_tokens))

    from backend.triton_server import ServerPorts, TritonServer
    work = Path(tempfile.mkdtemp(prefix="bench-perf-analyzer-"))
    server = TritonServer(repository(params, work), ServerPorts.free(), log_path=work / "server.log",
                          extra_args=["--model-control-mode=explicit", "--load-model=llm",
                                      "--load-model=stream_ceiling"])
    server.start()
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    runs: dict[str, list[Streamed]] = {side: [] for side in SIDES[1:]}
    cpu: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES[1:]}
    inproc_cpu: list[float] = []
    try:
        ready_s = server.wait_ready(900)
        run_perf_analyzer(server.grpc_url, "llm", ["warm", "up"], [4, 4], work)
        local = InProcess(engine_args, rounds[0][0][:2])

        def via(model: str, side: str, texts: list[str], lengths: list[int], profile: bool) -> float:
            spy = start_py_spy(stub_pid(server.process.pid, model), args.py_spy) if profile else None
            before = process_cpu(server.process.pid)
            run = run_perf_analyzer(server.grpc_url, model, texts, lengths, work)
            after = process_cpu(server.process.pid)
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file and exits
                spy.wait(60)
            used = {k: after[k] - before.get(k, 0.0) for k in after}
            used["perf_analyzer"] = run.client_cpu_s
            cpu[side].append(used)
            runs[side].append(run)
            return run.rate

        for r, (texts, lengths) in enumerate(rounds):
            order = list(SIDES)[r % 3:] + list(SIDES)[:r % 3]
            for side in order:
                tagged = [f"{SIDES.index(side)} {t}" for t in texts]
                if side == SIDES[0]:
                    before = time.process_time()  # this process: the engine alone meanwhile
                    rates[side].append(local.rate(tagged, lengths))
                    inproc_cpu.append(time.process_time() - before)
                else:
                    model = "llm" if side == SIDES[1] else "stream_ceiling"
                    rates[side].append(via(model, side, tagged, lengths,
                                           bool(args.py_spy) and r == 0 and model == "llm"))
    finally:
        server.stop()
    report(args, rounds, rates, runs, cpu, inproc_cpu, ready_s)


def report(args, rounds, rates, runs, cpu, inproc_cpu, ready_s) -> None:
    print(f"\n{args.workload} workload, {args.rounds} rounds of {len(rounds[0][0])} requests "
          f"({sum(rounds[0][1])} output tokens in round 0), sides rotated in each round; "
          f"CPU {cpu_features.detect().describe()}; stream_interval {args.stream_interval}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    inproc = rates[SIDES[0]]
    for side in SIDES:
        each = ", ".join(f"{x:.0f}" for x in rates[side])
        print(f"{side:<32}{max(rates[side]):>9.1f} tok/s best   rounds [{each}]")
    print("same round, Triton / in-process: " + ", ".join(
        f"{t / i:.1%}" for t, i in zip(rates[SIDES[1]], inproc))
        + f"; best / best {max(rates[SIDES[1]]) / max(inproc):.1%}")
    print("in-process: CPU s per round " + "; ".join(f"{c:.1f}" for c in inproc_cpu))
    for side in SIDES[1:]:
        r0 = runs[side][0]
        print(f"{side}: {r0.responses} responses for {r0.tokens} tokens in round 0; CPU s per round "
              + "; ".join(", ".join(f"{k} {v:.1f}" for k, v in sorted(c.items()) if v >= 0.05)
                          for c in cpu[side]))
    # Triton's own streaming cost, from the engine-less model: the CPU seconds its
    # responses took (client, server, stub), and what that leaves the engine. A round
    # that sends R responses/s on a host whose streaming path alone carries C spends
    # R / C of the host on it; if the engine loses just that, Triton / in-process is
    # 1 - R / C (OpenMP barriers stalled by the preempting work lose more).
    per_response = [sum(v for k, v in c.items() if k != "stub llm") / run.responses
                    for c, run in zip(cpu[SIDES[2]], runs[SIDES[2]])]
    print("stream_ceiling: responses/s per round " + ", ".join(
        f"{run.responses / run.seconds:.0f}" for run in runs[SIDES[2]])
        + "; CPU us per response (perf_analyzer + tritonserver + stub) "
        + ", ".join(f"{1e6 * x:.0f}" for x in per_response))
    bounds = [1 - (run.responses / run.seconds) / (ceil.responses / ceil.seconds)
              for run, ceil in zip(runs[SIDES[1]], runs[SIDES[2]])]
    print("what Triton's own streaming cost leaves, 1 - responses/s sent / ceiling "
          "responses/s, per round: " + ", ".join(f"{b:.1%}" for b in bounds))
    print(f"server start to ready: {ready_s:.1f} s")


if __name__ == "__main__":
    main()
