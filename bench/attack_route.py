"""Issue 43's attacks on the OpenAI route, each with a bystander asking a short greedy
completion every second. Per attack: what the attacker got, the bystander's p50 / max
latency (and failures), the route's memory before and at its peak, and Triton's running
requests and KV usage after the attacker left.

  python -m bench.attack_route [--route-tree DIR] [--model tiny|default] [--slow 3000]

It starts a tritonserver with one `llm` model and `python -m openai_frontend` in front of
it, run from --route-tree (default: this checkout; pass a copy of an older tree to get
the "before" figures; the route keeps its default flags either way). Not a test: it
prints figures.

Over 300 lines: every attack and its bystander in one script, so one command gives the
whole table; bench/'s move (issue 48 item 2) splits it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer, free_port

KEY = "attack-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVED = "bench"
TINY = {"dtype": "float32", "block_size": "16", "num_kv_blocks": "512", "max_num_seqs": "64",
        "max_model_len": "512", "max_num_batched_tokens": "1024"}
DEFAULT = {"dtype": "auto", "block_size": "16", "num_kv_blocks": "512", "max_num_seqs": "64",
           "max_model_len": "1024", "max_num_batched_tokens": "1024"}


def gauge(metrics_url: str, name: str) -> float:
    total = 0.0
    for line in requests.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith(name + "{") and 'model="llm"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class Bystander:
    """A short greedy completion every second; latencies (None: failed) per window."""

    def __init__(self, url: str, process: psutil.Process) -> None:
        self.url = url
        self.process = process
        self.samples: list[float | None] = []
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                r = requests.post(f"{self.url}/v1/completions", headers=AUTH, timeout=60, json={
                    "model": SERVED, "prompt": "The capital of France is", "max_tokens": 8,
                    "temperature": 0})
                self.samples.append(time.perf_counter() - started if r.status_code == 200 else None)
            except requests.RequestException:
                self.samples.append(None)
            with_rss = self.rss()
            self.peak_rss = max(self.peak_rss, with_rss)
            self._stop.wait(max(0.0, 1.0 - (time.perf_counter() - started)))

    def rss(self) -> int:
        try:
            return self.process.memory_info().rss
        except psutil.Error:
            return 0

    def __enter__(self) -> "Bystander":
        self.before_rss = self.peak_rss = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=90)

    def summary(self) -> str:
        ok = [s for s in self.samples if s is not None]
        failed = len(self.samples) - len(ok)
        if not ok:
            return f"bystander: {failed}/{len(self.samples)} failed"
        return (f"bystander p50 {statistics.median(ok) * 1000:.0f} ms, max {max(ok) * 1000:.0f} ms, "
                f"{failed}/{len(self.samples)} failed; route RSS {self.before_rss / 2**20:.0f} MB -> "
                f"peak {self.peak_rss / 2**20:.0f} MB")


def raw_post(url: str, path: str, body: dict, rcvbuf: int | None = None,
             key: str = KEY) -> socket.socket:
    """A socket that has sent the request (with a receive buffer of `rcvbuf` bytes, so
    a client that reads nothing fills up soon) and reads nothing yet."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                 + data)
    return sock


def first_line(sock: socket.socket, timeout: float = 3.0) -> str:
    sock.settimeout(timeout)
    try:
        return sock.recv(200).split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
    except socket.timeout:
        return "no answer yet"
    except OSError as exc:
        return type(exc).__name__


def after_leaving(metrics: str, wait: float) -> str:
    """Triton 1 s after the client left, and the tokens it made for nobody in `wait` s."""
    tokens = gauge(metrics, "vllm:generation_tokens_total")
    time.sleep(1)
    state = (f"1 s after the client left Triton had {gauge(metrics, 'vllm:num_requests_running'):.0f} "
             f"running, {gauge(metrics, 'vllm:num_requests_waiting'):.0f} waiting, "
             f"KV {gauge(metrics, 'vllm:kv_cache_usage_perc') * 100:.1f}%")
    time.sleep(max(0.0, wait - 1))
    made = gauge(metrics, "vllm:generation_tokens_total") - tokens
    return f"{state}; {made:.0f} tokens made for nobody in {wait:.0f} s"


def drain_triton(metrics: str, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and (gauge(metrics, "vllm:num_requests_running")
                                           or gauge(metrics, "vllm:num_requests_waiting")):
        time.sleep(1)


def attack_orphan(url, metrics, max_tokens, wait):
    sock = raw_post(url, "/v1/completions", {"model": SERVED, "prompt": "Hello", "n": 16,
                                            "max_tokens": max_tokens, "min_tokens": max_tokens,
                                            "temperature": 1.0})
    time.sleep(3)
    sock.close()
    return after_leaving(metrics, wait)


def attack_batch(url, metrics, max_tokens, wait):
    sock = raw_post(url, "/v1/completions", {
        "model": SERVED, "prompt": [f"prompt number {i}" for i in range(1000)], "n": 2,
        "max_tokens": max_tokens, "temperature": 1.0})
    answer = first_line(sock, 3)
    sock.close()
    return f"answer {answer!r}; " + after_leaving(metrics, wait)


def unread_stream(url: str, max_tokens: int) -> socket.socket:
    """16 sequences of big events (20 top logprobs each) to a client that never reads."""
    return raw_post(url, "/v1/chat/completions", {
        "model": SERVED, "messages": [{"role": "user", "content": "Hello"}], "n": 16,
        "max_tokens": max_tokens - 80, "min_tokens": max_tokens - 80, "temperature": 1.0,
        "stream": True, "logprobs": True, "top_logprobs": 20}, rcvbuf=4096)


def attack_unread_stream(url, metrics, max_tokens, wait):
    """Looked at `wait` s in, and again past the route's default --stream-idle-timeout."""
    sock = unread_stream(url, max_tokens)
    states, waited = [], 0.0
    for until in (wait, 30 + wait):
        time.sleep(until - waited)
        waited = until
        states.append(f"{until:.0f} s unread: Triton running "
                      f"{gauge(metrics, 'vllm:num_requests_running'):.0f}, "
                      f"KV {gauge(metrics, 'vllm:kv_cache_usage_perc') * 100:.1f}%")
    sock.close()
    counted = "absent"
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('openai_frontend:requests_cancelled_total{reason="stream_not_read"}'):
            counted = line.rsplit(" ", 1)[1]
    return "; ".join(states) + f"; route's stream_not_read count: {counted}"


def attack_tokenize(url, metrics, max_tokens, wait):
    body = json.dumps({"model": SERVED, "prompt": "hello " * (8_000_000 // 6)}).encode()

    def one(_):
        started = time.perf_counter()
        try:
            r = requests.post(f"{url}/tokenize", data=body, timeout=300,
                              headers={**AUTH, "Content-Type": "application/json"})
            return f"{r.status_code} in {time.perf_counter() - started:.1f} s"
        except requests.RequestException as exc:
            return f"{type(exc).__name__} in {time.perf_counter() - started:.1f} s"

    with ThreadPoolExecutor(2) as pool:
        return "six 8 MB /tokenize: " + ", ".join(pool.map(one, range(6)))


def attack_slow_connections(url, metrics, count, hold):
    host, port = url.removeprefix("http://").split(":")
    held, failed = [], 0
    for _ in range(count):
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            held.append(sock)
        except OSError:
            failed += 1
    time.sleep(hold)
    closed = refused = 0
    for sock in held:
        sock.setblocking(False)
        try:
            data = sock.recv(64)
            refused += data.startswith(b"HTTP/1.1 503")
            closed += not data or data.startswith(b"HTTP/1.1 503")
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        sock.close()
    return (f"{count} slow connections: {failed} could not connect, {refused} answered 503, "
            f"{closed} closed by the route after {hold:.0f} s")


def attack_surrogates(url, metrics, max_tokens, wait):
    got = []
    for path, body in (("/v1/completions", {"model": SERVED, "prompt": "a\ud800", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": SERVED, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "\ud800"}]}),
                       ("/tokenize", {"model": SERVED, "prompt": "\ud800"})):
        got.append(f"{path} {requests.post(f'{url}{path}', json=body, headers=AUTH, timeout=30).status_code}")
    return ", ".join(got)


def start_triton(work: Path, model: str) -> TritonServer:
    from testing.tiny_model import make_tiny_model_dir

    args = ({"model": str(make_tiny_model_dir(work / "tiny")), **TINY} if model == "tiny"
            else {"model": "", **DEFAULT})
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=["llm"],
                           params={"llm": args})
    server = TritonServer(repo, ServerPorts.free(), log_path=work / "tritonserver.log",
                          extra_args=["--exit-timeout-secs=15"])
    server.start()
    server.wait_ready(timeout=600)
    return server


def start_route(tree: Path, triton: TritonServer, tokenizer: str | None, log: Path):
    port = free_port()
    command = [sys.executable, "-m", "openai_frontend", "--triton-grpc", triton.grpc_url,
               "--model", "llm", "--served-model-name", SERVED,
               "--triton-metrics", triton.metrics_url, "--host", "127.0.0.1",
               "--port", str(port), "--api-key", KEY, "--log-level", "warning"]
    if tokenizer:
        command += ["--tokenizer", tokenizer]
    out = open(log, "wb")
    process = subprocess.Popen(command, cwd=tree, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the route exited: see {log}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the route was not healthy in 120 s")
        time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--route-tree", type=Path, default=REPO_ROOT,
                    help="the checkout whose openai_frontend runs (default: this one)")
    ap.add_argument("--model", choices=["tiny", "default"], default="tiny")
    ap.add_argument("--slow", type=int, default=3000, help="slow connections to open")
    ap.add_argument("--wait", type=float, default=10.0, help="seconds to look after an attack")
    ap.add_argument("--only", nargs="*", default=None, help="attack names to run")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="attack-route-"))
    triton = start_triton(work, args.model)
    metrics = f"http://{triton.metrics_url}" if "://" not in triton.metrics_url else triton.metrics_url
    tokenizer = str(work / "tiny") if args.model == "tiny" else None
    log = work / "route.log"
    process = None
    try:
        process, url = start_route(args.route_tree, triton, tokenizer, log)
        route = psutil.Process(process.pid)
        max_tokens = int((TINY if args.model == "tiny" else DEFAULT)["max_model_len"]) - 16
        attacks = [("orphan n=16", attack_orphan, max_tokens),
                   ("batch 1000 x n=2", attack_batch, max_tokens),
                   ("unread stream", attack_unread_stream, max_tokens),
                   ("8 MB /tokenize", attack_tokenize, max_tokens),
                   ("slow connections", attack_slow_connections, args.slow),
                   ("lone surrogates", attack_surrogates, max_tokens)]
        print(f"route from {args.route_tree}, model {args.model}; log {log}")
        for name, attack, size in attacks:
            if args.only and name.split()[0] not in args.only:
                continue
            drain_triton(metrics)
            log_before = log.stat().st_size
            with Bystander(url, route) as bystander:
                time.sleep(2)
                result = attack(url, metrics, size, args.wait)
                time.sleep(2)
            grown = log.stat().st_size - log_before
            print(f"[{name}] {result}\n    {bystander.summary()}; route log +{grown} bytes",
                  flush=True)
        # SIGTERM with requests in flight: a whole answer and a stream nobody reads.
        drain_triton(metrics, 120)
        sockets = [raw_post(url, "/v1/completions", {
            "model": SERVED, "prompt": "Hello", "n": 16, "max_tokens": max_tokens,
            "min_tokens": max_tokens, "temperature": 1.0}), unread_stream(url, max_tokens)]
        time.sleep(2)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
            exit_s = f"exited in {time.monotonic() - started:.1f} s"
        except subprocess.TimeoutExpired:
            exit_s = "still running 60 s after SIGTERM"
        for sock in sockets:
            sock.close()
        print(f"[SIGTERM, n=16 + unread stream in flight] {exit_s}; "
              f"{after_leaving(metrics, 2)}", flush=True)
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        triton.stop()


if __name__ == "__main__":
    main()
