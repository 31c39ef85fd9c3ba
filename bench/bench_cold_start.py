"""Cold start as a user meets it: start `scripts/serve.py` (the `llm` model only), time it to
ready, then run the same genai-perf-style load twice (8 concurrent streams, 40 requests,
~64-token prompts, 32 output tokens), the second time on fresh prompts so prefix-cache hits
cannot flatter it. Prints ready time and both runs' TTFT and request latency side by side.

  python -m bench.bench_cold_start [--param KEY=VALUE ...] [--busy 0]

--busy N starts N CPU-bound processes beside the server for both runs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer
from client_examples import bench_serving
from kernels.cpu import features as cpu_features


def load_run(url: str, seed: int, out: Path) -> dict:
    bench_serving.main(["--url", url, "--concurrency", "8", "--num-prompts", "40",
                        "--prompt-words", "48:48", "--output-tokens", "32:32", "--warmup", "0",
                        "--seed", str(seed), "--out", str(out), "--plot", str(out.with_suffix(".png"))])
    return json.loads(out.read_text())["levels"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound neighbour processes")
    args = ap.parse_args()
    ports = ServerPorts.free()
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), "--load-model", "llm",
           "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
           "--metrics-port", str(ports.metrics), *[f"--param={p}" for p in args.param]]
    probe = TritonServer(Path("."), ports)
    started = time.monotonic()
    serve = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        while not probe.is_ready():
            if serve.poll() is not None:
                sys.exit(f"serve exited with {serve.returncode} before ready")
            time.sleep(0.1)
        ready_s = time.monotonic() - started
        with tempfile.TemporaryDirectory() as tmp:
            first = load_run(probe.grpc_url, 1, Path(tmp) / "first.json")
            again = load_run(probe.grpc_url, 2, Path(tmp) / "again.json")
    finally:
        for proc in spinners:
            proc.kill()
        serve.terminate()
        serve.wait(timeout=60)
    print(f"\nCPU {cpu_features.detect().describe()}; {args.busy} busy neighbour(s); "
          f"params {args.param or 'defaults'}; ready {ready_s:.1f} s after serve started")
    print(f"{'':<22}{'first run':>12}{'fresh prompts':>15}{'first/again':>13}")
    rows = [("TTFT mean ms", lambda lv: lv["ttft_ms"]["mean"]),
            ("TTFT max ms", lambda lv: _max_ms(lv, "ttft_s")),
            ("latency mean ms", lambda lv: lv["e2e_ms"]["mean"]),
            ("latency max ms", lambda lv: _max_ms(lv, "e2e_s")),
            ("ITL mean ms", lambda lv: lv["itl_ms"]["mean"]),
            ("output tok/s", lambda lv: lv["output_tokens_per_s"])]
    for label, value in rows:
        a, b = value(first), value(again)
        print(f"{label:<22}{a:>12.1f}{b:>15.1f}{a / b:>13.2f}")
    print(f"failed requests: {first['failed']} / {again['failed']}")


def _max_ms(level: dict, key: str) -> float:
    return 1000.0 * max(r[key] for r in level["requests"] if r[key] is not None)


if __name__ == "__main__":
    main()
