"""The live tuner on a real server: predicted vs measured after `--apply`, in one run.

  python -m bench.bench_live_tuning [--rate 0.8] [--record 60] [--window 60]
                                    [--set max_num_seqs=2 ...] [--max-step-error 0.25]

Starts tritonserver (explicit model control) with `llm` on the embedded SmolLM2 (float32;
or --tiny) under a deliberately narrow setting (default max_num_seqs=2) that records a
trace, streams Poisson arrivals (prompts of 32-160 words, 16-64 output tokens) on one
gRPC stream, and after --record seconds runs `python -m tuning.tune --server ... --apply`
while the load goes on. The tool prints its recommendation, loads the model again with it, measures
--window seconds and prints predicted vs measured. Then the load stops and every request
sent is accounted for (completed, errors).
"""
from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer
from bench.bench_generate import WORDS
from client_examples.common import build_grpc_inputs, chunk_from_grpc_result
from kernels.cpu import features as cpu_features


class PoissonLoad:
    """Streaming requests at `rate` per second on one gRPC stream, until stopped."""

    def __init__(self, url: str, rate: float, seed: int = 0) -> None:
        import tritonclient.grpc as grpcclient
        self.client = grpcclient.InferenceServerClient(url=url)
        self.rate, self.rng = rate, random.Random(seed)
        self.sent = self.completed = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._send)

    def _on_response(self, result, error) -> None:
        with self.lock:
            if error is not None:
                self.errors.append(str(error))
            elif chunk_from_grpc_result(time.perf_counter(), result).final:
                self.completed += 1

    def _send(self) -> None:
        self.client.start_stream(callback=self._on_response)
        while not self.stop.wait(self.rng.expovariate(self.rate)):
            text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(32, 160)))
            n = self.rng.randint(16, 64)
            sampling = {"temperature": 0, "max_tokens": n, "min_tokens": n, "ignore_eos": True}
            try:
                self.client.async_stream_infer("llm", build_grpc_inputs(text, sampling),
                                               request_id=str(self.sent),
                                               enable_empty_final_response=True)
            except Exception as exc:  # the stream broke: its error came to the callback
                with self.lock:
                    self.errors.append(f"sending stopped: {exc}")
                return
            with self.lock:
                self.sent += 1

    def start(self) -> None:
        self.thread.start()

    def finish(self, timeout: float = 120.0) -> None:
        self.stop.set()
        self.thread.join()
        deadline = time.monotonic() + timeout
        while self.completed + len(self.errors) < self.sent and time.monotonic() < deadline:
            time.sleep(0.2)
        self.client.stop_stream()
        self.client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.8, help="requests per second")
    ap.add_argument("--record", type=float, default=60.0, help="seconds recorded first")
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--set", action="append", default=["max_num_seqs=2"], metavar="K=V")
    ap.add_argument("--slo-ttft-p99", default="2.0")
    ap.add_argument("--slo-itl-p99", default="0.2")
    ap.add_argument("--max-step-error", default="0.25")
    ap.add_argument("--tiny", action="store_true", help="a random-weight Llama (hidden 256, "
                    "4 layers) instead of SmolLM2: steps of milliseconds on a busy host")
    args = ap.parse_args()
    from tuning.tune import main as tune

    work = Path(tempfile.mkdtemp(prefix="live-tuning-"))
    model = ""
    if args.tiny:
        from testing.tiny_model import make_tiny_model_dir
        model = str(make_tiny_model_dir(work / "tiny", hidden_size=256, intermediate_size=1024,
                                        num_hidden_layers=4))
    params = {"model": model, "dtype": "float32", "max_model_len": "1024",
              "trace_path": str(work / "trace.jsonl"), **dict(s.split("=", 1) for s in args.set)}
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=["llm"],
                           params={"llm": params})
    server = TritonServer(repo, ServerPorts.free(), log_path=work / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", "--load-model=llm"])
    print(f"host: {cpu_features.detect().describe()}; start: {params}", flush=True)
    server.start()
    try:
        server.wait_ready(timeout=900)
        load = PoissonLoad(server.grpc_url, args.rate)
        load.start()
        time.sleep(args.record)
        code = 0
        try:
            tune(["--server", server.http_url, "--slo-ttft-p99", args.slo_ttft_p99,
                  "--slo-itl-p99", args.slo_itl_p99, "--quiet", "--apply", "--window",
                  str(args.window), "--max-step-error", args.max_step_error,
                  "--saved-config", str(work / "previous.json")])
        except SystemExit as exit_:
            code = exit_.code
        load.finish()
        print(f"tuner exit status {code}; load: {load.sent} sent, {load.completed} completed, "
              f"{len(load.errors)} errors {load.errors[:1]}; files in {work}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
