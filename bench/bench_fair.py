"""Two tenants through Triton, one sending 10x the other's load: each tenant's TTFT p50/p99
and output tokens/s under policy fcfs and fair (and fcfs with admission=no_evict), side
by side in one run; then the fcfs run's recorded trace replayed under both admission modes.

  python -m bench.bench_fair [--model PATH] [--light-rate 1.0] [--duration 20]

One tritonserver serves three copies of `llm` with the same engine arguments but the
policy / admission; the load runs against one copy at a time (open loop, Poisson arrivals
with a fixed seed, the same schedule for every copy), after a run of the light tenant
alone. Default model: a tiny random-weight Llama (testing/tiny_model.py), so the figures
show the scheduler, not the model; every request asks for exactly --tokens output tokens.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer
from client_examples.common import build_grpc_inputs, chunk_from_grpc_result
from kernels.cpu import features as cpu_features

# A pool of 24 blocks: four running requests of ~100 + 48 tokens (10 blocks each at their
# worst) do not fit, so max_utilization preempts and no_evict admits fewer.
ENGINE = {"dtype": "float32", "block_size": "16", "max_num_seqs": "4", "max_model_len": "256",
          "num_kv_blocks": "24", "max_num_batched_tokens": "256"}
MODELS = {"llm_fcfs": {"policy": "fcfs"}, "llm_fair": {"policy": "fair"},
          "llm_no_evict": {"policy": "fcfs", "admission": "no_evict"}}


def schedule(light_rate: float, duration: float, tenants=("light", "heavy"), seed=0):
    """(send time, tenant, prompt) in time order; heavy at 10x light's rate."""
    rng = random.Random(seed)
    out = []
    for tenant in tenants:
        rate = light_rate * (10 if tenant == "heavy" else 1)
        t = rng.expovariate(rate)
        while t < duration:
            words = " ".join(f"w{rng.randrange(1000)}" for _ in range(24))
            out.append((t, tenant, f"{tenant} {len(out)}: {words}"))
            t += rng.expovariate(rate)
    return sorted(out)


def run_load(url: str, model: str, plan, tokens: int):
    """Sends `plan` on one gRPC stream; per request: (tenant, send, first token, finish)."""
    import tritonclient.grpc as grpcclient
    times: dict[int, list] = {}
    pending = set(range(len(plan)))
    done, lock, errors = threading.Event(), threading.Lock(), []

    def on_response(result, error) -> None:
        now = time.perf_counter()
        with lock:
            if error is not None:
                errors.append(str(error))
                done.set()
                return
            chunk = chunk_from_grpc_result(now, result)
            index = int(result.get_response().id)
            if times[index][2] is None and chunk.text:
                times[index][2] = now
            if chunk.final:
                times[index][3] = now
                pending.discard(index)
                if not pending:
                    done.set()

    client = grpcclient.InferenceServerClient(url=url)
    client.start_stream(callback=on_response)
    t0 = time.perf_counter()
    for i, (at, tenant, prompt) in enumerate(plan):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sampling = {"temperature": 0, "max_tokens": tokens, "min_tokens": tokens,
                    "ignore_eos": True, "tenant": tenant}
        with lock:
            times[i] = [tenant, time.perf_counter(), None, None]
        client.async_stream_infer(model, build_grpc_inputs(prompt, sampling, return_flags=()),
                                  request_id=str(i), enable_empty_final_response=True)
    done.wait(timeout=1800)
    client.stop_stream()
    client.close()
    if errors or pending:
        raise RuntimeError(f"{model}: {len(errors)} errors, {len(pending)} unfinished; first: "
                           f"{errors[0] if errors else 'timeout'}")
    return list(times.values())


def per_tenant(records, tokens: int) -> dict[str, tuple[float, float, float, int]]:
    """tenant -> (TTFT p50 s, TTFT p99 s, output tokens/s over the run, requests)."""
    start = min(r[1] for r in records)
    end = max(r[3] for r in records)
    out = {}
    for tenant in sorted({r[0] for r in records}):
        mine = [r for r in records if r[0] == tenant]
        ttft = np.array([r[2] - r[1] for r in mine])
        out[tenant] = (float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99)),
                       len(mine) * tokens / (end - start), len(mine))
    return out


def preemptions(metrics_url: str, model: str) -> float:
    import requests
    total = 0.0
    for line in requests.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("vllm:num_preemptions_total{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def replay_admissions(trace_path: Path) -> str:
    from tuning.replay import measured, replay
    from tuning.step_model import held_out_error, step_durations
    from tuning.trace_file import read_trace
    trace = read_trace(trace_path)
    model, _ = held_out_error(step_durations(trace))
    rows = {"recorded (fcfs, max_utilization)": measured(trace),
            "replay max_utilization": replay(trace, model, {"admission": "max_utilization"}),
            "replay no_evict": replay(trace, model, {"admission": "no_evict"})}
    lines = [f"{'':36s}{'TTFT p50':>9s}{'p99':>8s}{'ITL p50 ms':>11s}{'p99':>7s}"
             f"{'tok/s':>8s}{'preempt':>8s}"]
    for name, s in rows.items():
        lines.append(f"{name:36s}{s.ttft['p50']:9.3f}{s.ttft['p99']:8.3f}"
                     f"{s.itl['p50'] * 1e3:11.1f}{s.itl['p99'] * 1e3:7.1f}"
                     f"{s.output_tokens_per_s:8.1f}{s.preemptions:8d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: a tiny random Llama)")
    parser.add_argument("--light-rate", type=float, default=1.0, help="light's requests/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-fair-"))
    model = args.model
    if model is None:
        from testing.tiny_model import make_tiny_model_dir
        model = str(make_tiny_model_dir(work / "tiny"))
    trace = work / "fcfs-trace.jsonl"
    params = {name: {"model": model, **ENGINE, **extra} for name, extra in MODELS.items()}
    params["llm_fcfs"]["trace_path"] = str(trace)
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=[],
                           renames={name: "llm" for name in MODELS}, params=params)
    server = TritonServer(repo, ServerPorts.free(), log_path=work / "tritonserver.log")
    server.start()
    try:
        print(f"server ready in {server.wait_ready(timeout=600):.1f} s; CPU "
              f"{cpu_features.detect().describe()}")
        both = schedule(args.light_rate, args.duration)
        alone = [p for p in both if p[1] == "light"]
        results = {"light alone (fcfs)": per_tenant(
            run_load(server.grpc_url, "llm_no_evict", alone, args.tokens), args.tokens)}
        preempted = {}
        for name in MODELS:
            before = preemptions(server.metrics_url, name)
            records = run_load(server.grpc_url, name, both, args.tokens)
            results[f"{name} ({MODELS[name]})"] = per_tenant(records, args.tokens)
            preempted[name] = preemptions(server.metrics_url, name) - before
    finally:
        server.stop()
    print(f"\n{len(both)} requests in {args.duration:g} s (light {args.light_rate:g}/s, heavy "
          f"{10 * args.light_rate:g}/s), {args.tokens} output tokens each; engine {ENGINE}")
    print(f"{'run':52s}{'tenant':>7s}{'TTFT p50 s':>11s}{'p99 s':>8s}{'tok/s':>8s}{'reqs':>6s}")
    for run, tenants in results.items():
        for tenant, (p50, p99, rate, count) in tenants.items():
            print(f"{run:52s}{tenant:>7s}{p50:11.3f}{p99:8.3f}{rate:8.1f}{count:6d}")
    print("preemptions per run: " + ", ".join(f"{k} {v:g}" for k, v in preempted.items()))
    print(f"\nthe llm_fcfs run's trace ({trace}) replayed:\n{replay_admissions(trace)}")


if __name__ == "__main__":
    main()
