"""Output tokens/s through Triton (gRPC, `llm` model; streaming and one response per
request) vs in-process LLM.generate, same 64-request workloads, in one run.

  python -m bench.bench_triton [--workload fixed|variable] [--repeat 3]
                               [--stream-interval N] [--quantization gguf]

The server runs the repository's `llm` model as shipped (embedded SmolLM2, dtype auto,
max_num_seqs 64, max_model_len 2048); the in-process engine gets the same arguments.
--stream-interval sets the model's stream_interval (output tokens per streamed response;
1, the default, sends every step's text); --quantization is set on both sides.
Every request asks for exactly its output length (min_tokens = max_tokens, ignore_eos).
Round r runs the three sides (in-process, streaming, one response) in a rotating order on
the workload drawn with seed r, each prompt led by a digit of the side's own, so no run
hits the prefix cache of another; each side reports its best round (the host's speed
drifts by +-20% between minutes) and each round's ratio to in-process is printed too.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from bench.bench_generate import make_workload
from client_examples.common import build_grpc_inputs, chunk_from_grpc_result
from engine import LLM, SamplingParams
from engine.models import default_model_dir
from kernels.cpu import features as cpu_features

REPO = Path(__file__).resolve().parent.parent / "model_repository"


Rounds = list[tuple[list[str], list[int]]]  # (prompts, output lengths) per round


class InProcess:
    """The in-process side: one LLM, built once, timed one round at a time."""

    def __init__(self, engine_args: dict[str, str], warm_up: list[str]) -> None:
        self.llm = LLM(None, max_num_seqs=64, max_model_len=2048, **engine_args)  # dtype auto, as the server
        self.llm.generate(warm_up, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)

    def rate(self, texts: list[str], lengths: list[int]) -> float:
        params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
                  for n in lengths]
        t0 = time.perf_counter()
        outs = self.llm.generate(texts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths
        return sum(lengths) / elapsed


def stream_all(url: str, texts: list[str], lengths: list[int],
               stream: bool = True) -> tuple[float, list[int]]:
    """All requests on one gRPC stream (as genai-perf multiplexes them), so the client's
    own CPU use stays small on a machine it shares with the server."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url=url)
    produced = [0] * len(texts)
    pending = set(range(len(texts)))
    errors: list[str] = []
    done = threading.Event()
    lock = threading.Lock()

    def on_response(result, error) -> None:
        with lock:
            if error is not None:
                errors.append(str(error))
                done.set()
                return
            chunk = chunk_from_grpc_result(time.perf_counter(), result)
            index = int(result.get_response().id)
            produced[index] += chunk.num_output_tokens or 0
            if chunk.final:
                pending.discard(index)
                if not pending:
                    done.set()

    client.start_stream(callback=on_response)
    t0 = time.perf_counter()
    for i, (text, n) in enumerate(zip(texts, lengths)):
        sampling = {"temperature": 0, "max_tokens": n, "min_tokens": n, "ignore_eos": True}
        client.async_stream_infer("llm", build_grpc_inputs(text, sampling, stream=stream,
                                                           return_flags=("return_num_output_tokens",)),
                                  request_id=str(i),
                                  enable_empty_final_response=True)
    done.wait(timeout=1800)
    elapsed = time.perf_counter() - t0
    client.stop_stream()
    client.close()
    if errors or pending:
        raise RuntimeError(f"{len(errors)} errors, {len(pending)} unfinished; first: "
                           f"{errors[0] if errors else 'timeout'}")
    return elapsed, produced


def repository_with(params: dict[str, str], work: Path) -> Path:
    """The shipped repository, or a copy whose `llm` config.pbtxt adds `params`."""
    if not params:
        return REPO
    repo = work / "repo"
    shutil.copytree(REPO / "llm", repo / "llm")
    with open(repo / "llm" / "config.pbtxt", "a") as config:
        for key, value in params.items():
            config.write(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n')
    return repo


SIDES = {None: "in-process LLM.generate", True: "Triton gRPC, streaming", False: "Triton gRPC, one response"}


@dataclass
class Results:
    ready_s: float
    rates: dict[str, list[float]] = field(default_factory=lambda: {side: [] for side in SIDES.values()})
    cpu: dict[str, list["CpuSeconds"]] = field(default_factory=lambda: {SIDES[True]: [], SIDES[False]: []})


def alternated(rounds: Rounds, engine_args: dict[str, str], params: dict[str, str]) -> Results:
    """Round r runs in-process, streaming and one response on the workload of seed r, the
    three in a rotating order, so no side gets all of the host's slow minutes. The server
    is up (and idle) while in-process runs, and the in-process engine idle while the
    server works."""
    from backend.triton_server import ServerPorts, TritonServer
    work = Path(tempfile.mkdtemp(prefix="bench-triton-"))
    server = TritonServer(repository_with(params, work), ServerPorts.free(), log_path=work / "server.log",
                          extra_args=["--model-control-mode=explicit", "--load-model=llm"])
    server.start()
    try:
        results = Results(ready_s=server.wait_ready(900))
        stream_all(server.grpc_url, rounds[0][0][:2], [4, 4])  # warm-up
        local = InProcess(engine_args, rounds[0][0][:2])

        def via_triton(stream: bool, texts: list[str], lengths: list[int]) -> float:
            before = cpu_seconds(server.process.pid)
            elapsed, produced = stream_all(server.grpc_url, texts, lengths, stream)
            results.cpu[SIDES[stream]].append(cpu_seconds(server.process.pid) - before)
            if produced != lengths:
                raise RuntimeError("the server returned other output lengths than requested")
            return sum(lengths) / elapsed

        runs = {SIDES[None]: local.rate, SIDES[True]: partial(via_triton, True),
                SIDES[False]: partial(via_triton, False)}
        for r, (texts, lengths) in enumerate(rounds):
            order = list(runs)[r % 3:] + list(runs)[:r % 3]
            for side in order:
                # A digit of its own in front (one token) keeps the server's second side
                # of a round from hitting the prefix cache its first side filled.
                tag = list(runs).index(side)
                results.rates[side].append(runs[side]([f"{tag} {t}" for t in texts], lengths))
        return results
    finally:
        server.stop()


@dataclass(frozen=True)
class CpuSeconds:
    """CPU time by process: this client, tritonserver itself, its backend stubs (the
    engine), over a round; on a host the client shares, what the engine did not get."""
    client: float
    server: float
    stubs: float

    def __sub__(self, other: "CpuSeconds") -> "CpuSeconds":
        return CpuSeconds(self.client - other.client, self.server - other.server,
                          self.stubs - other.stubs)


def cpu_seconds(server_pid: int) -> CpuSeconds:
    import psutil

    def used(process) -> float:
        times = process.cpu_times()
        return times.user + times.system
    server = psutil.Process(server_pid)
    stubs = sum(used(child) for child in server.children(recursive=True))
    return CpuSeconds(time.process_time(), used(server), stubs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["fixed", "variable"], default="fixed")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per side; the best is reported")
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--quantization", choices=["gguf"], default=None)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="an engine argument for both sides (repeatable), e.g. num_threads=2")
    args = ap.parse_args()
    engine_args = {"quantization": args.quantization} if args.quantization else {}
    engine_args.update(item.split("=", 1) for item in args.set)
    params = dict(engine_args)
    if args.stream_interval != 1:
        params["stream_interval"] = str(args.stream_interval)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    rounds = []
    for seed in range(args.repeat):
        w = make_workload(args.workload, tok, seed=seed)
        rounds.append(([tok.decode(p) for p in w.prompts], w.max_tokens))
    results = alternated(rounds, engine_args, params)
    print(f"\n{args.workload} workload, {args.repeat} rounds of {len(rounds[0][0])} requests "
          f"({sum(rounds[0][1])} output tokens in round 0), the sides alternated in each round; "
          f"best round, then all rounds; CPU {cpu_features.detect().describe()}; stream_interval "
          f"{args.stream_interval}, quantization {args.quantization}")
    inproc = results.rates[SIDES[None]]
    for label, rates in results.rates.items():
        share = "" if rates is inproc else f"  ({max(rates) / max(inproc):.0%} of in-process)"
        print(f"{label:<28}{max(rates):>8.1f} tok/s{share:<26}  [{', '.join(f'{r:.0f}' for r in rates)}]")
    print("same round, Triton / in-process: " + "; ".join(
        f"{label.removeprefix('Triton gRPC, ')} "
        + ", ".join(f"{t / i:.0%}" for t, i in zip(results.rates[label], inproc))
        for label in (SIDES[True], SIDES[False])))
    print(f"server start to ready: {results.ready_s:.1f} s")
    for side in (SIDES[True], SIDES[False]):
        rates = results.rates[side]
        used = results.cpu[side][max(range(len(rates)), key=rates.__getitem__)]
        print(f"CPU seconds in its best round, {side.removeprefix('Triton gRPC, ')}: client "
              f"{used.client:.1f}, tritonserver {used.server:.1f}, engine stub {used.stubs:.1f}")


if __name__ == "__main__":
    main()
