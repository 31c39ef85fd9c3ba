"""Faults under the real scripts/serve.py --health-check on SmolLM2 (dtype auto), one
server for all of them (issue 28, item 3):
- the trace target is full (a link to /dev/full): tracing switches off with one log line
  and the 16 streams it traced finish as usual;
- a KV-event subscriber that never reads: the same streams finish, and a reading
  subscriber beside it gets every batch in order;
- SIGKILL of the python backend stub while 16 streams run: every client gets an error
  within seconds, the model reports not ready, serve logs it (or tritonserver's own crash
  on it), starts tritonserver again and the model serves."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from backend.repository_layout import copy_repository
from backend.stub_watch import stubs_of
from backend.triton_server import REPO_ROOT, ServerPorts, free_port
from bench.soak_client import SoakClient, StreamJob, encode_request
from bench.soak_requests import greedy_request

pytestmark = pytest.mark.slow

STREAMS = 16
ERROR_WITHIN_S = 15.0  # serve looks every second; measured ~2 s here
READY_TIMEOUT_S = 420.0
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


class Serve:
    def __init__(self, tmp_path) -> None:
        full = tmp_path / "trace.jsonl"
        full.symlink_to("/dev/full")  # a link: the trace's rotation renames it, not the device
        self.kv_port, self.replay_port = free_port(), free_port()
        kv_events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{self.kv_port}",
                     "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": "kv"}
        params = {"dtype": "auto", "max_num_seqs": str(STREAMS), "num_kv_blocks": "256",
                  "max_model_len": "1024", "trace_path": str(full), "trace_max_bytes": "1024",
                  "kv_events_config": json.dumps(kv_events)}
        repo = copy_repository(REPO_ROOT / "model_repository", tmp_path / "models",
                               models=["llm"], params={"llm": params})
        self.ports = ServerPorts.free()
        self.log = tmp_path / "serve.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), "--health-check",
                 "--model-repository", str(repo), "--http-port", str(self.ports.http),
                 "--grpc-port", str(self.ports.grpc), "--metrics-port", str(self.ports.metrics)],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def model_ready(self) -> bool:
        return _get(f"http://127.0.0.1:{self.ports.http}/v2/models/llm/ready") == 200

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        started = time.monotonic()
        while not self.model_ready():
            assert self.process.poll() is None, f"serve exited\n{self.tail()}"
            assert time.monotonic() - started < timeout, f"not ready\n{self.tail()}"
            time.sleep(0.25)
        return time.monotonic() - started

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def tritonserver_pid(self) -> int:
        children = subprocess.run(["pgrep", "-P", str(self.process.pid), "-x", "tritonserver"],
                                  capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children
        return int(children[0])


@pytest.fixture
def served(tmp_path):
    serve = Serve(tmp_path)
    yield serve
    if serve.process.poll() is None:
        serve.process.send_signal(signal.SIGTERM)
        try:
            serve.process.wait(60)
        except subprocess.TimeoutExpired:
            serve.process.kill()
            serve.process.wait()


def streams(max_tokens: int, forced: bool) -> list[StreamJob]:
    return [StreamJob([encode_request("llm", f"s{i}", greedy_request(
        PROMPTS[i % len(PROMPTS)], max_tokens, forced=forced).tensors())]) for i in range(STREAMS)]


async def run_streams(url: str, jobs: list[StreamJob], timeout: float = 300) -> list:
    client = SoakClient(url)
    try:
        done = await asyncio.gather(*(client.run(job, timeout=timeout) for job in jobs))
    finally:
        await client.close()
    return [next(iter(job.outcomes.values())) for job in done]


async def kill_stub_under_load(serve: Serve, pgid: int) -> tuple[float, list, list[int]]:
    """Starts the streams, SIGKILLs the stub once each has a response; returns the kill
    time (perf_counter), the outcomes and the model's readiness seen every 0.2 s after,
    until every stream ended and once more then."""
    jobs = streams(400, forced=True)
    client = SoakClient(serve.grpc)
    tasks = [asyncio.create_task(client.run(job, timeout=120)) for job in jobs]
    deadline = time.monotonic() + 180
    while not all(j.outcomes.get(f"s{i}") and j.outcomes[f"s{i}"].pieces
                  for i, j in enumerate(jobs)):
        assert time.monotonic() < deadline and not any(t.done() for t in tasks), "streams stalled"
        await asyncio.sleep(0.2)
    stub, = stubs_of(pgid)
    killed_at = time.perf_counter()
    os.kill(stub.pid, signal.SIGKILL)
    readiness = []
    while not all(t.done() for t in tasks) and time.perf_counter() - killed_at < 60:
        readiness.append(await asyncio.to_thread(serve.model_ready))
        await asyncio.sleep(0.2)
    done = await asyncio.gather(*tasks)
    readiness.append(serve.model_ready())
    await client.close()
    return killed_at, [j.outcomes[f"s{i}"] for i, j in enumerate(done)], readiness


def test_full_trace_deaf_subscriber_and_a_killed_stub(served):
    from tests.engine.core.kv_cache.test_kv_events import _subscriber

    served.wait_ready()
    deaf = _subscriber(served.kv_port, b"kv")  # never read until the end
    reader = _subscriber(served.kv_port, b"kv")
    time.sleep(0.5)  # PUB drops what it sends before a subscription reaches it
    outcomes = asyncio.run(run_streams(served.grpc, streams(24, forced=False)))
    assert all(o.error is None and o.final and o.text for o in outcomes), outcomes
    trace_lines = [line for line in served.text().splitlines() if "tracing switched off" in line]
    assert len(trace_lines) == 1 and "No space left on device" in trace_lines[0], trace_lines
    seqs = []
    while reader.poll(500):
        seqs.append(int.from_bytes(reader.recv_multipart()[1], "big"))
    assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    deaf.close(linger=0)
    reader.close(linger=0)
    with urllib.request.urlopen(f"http://127.0.0.1:{served.ports.metrics}/metrics") as page:
        dropped = re.findall(r'^vllm:kv_events_dropped_total\{[^}]*model="llm"[^}]*\} (\S+)$',
                             page.read().decode(), re.MULTILINE)
    assert dropped == ["0"], dropped  # the deaf one cost the engine's queue nothing

    first_server = served.tritonserver_pid()
    killed_at, outcomes, readiness = asyncio.run(kill_stub_under_load(served, first_server))
    late = [(o.request_id, o.error, o.error_at - killed_at) for o in outcomes
            if o.error is None or not 0 < o.error_at - killed_at <= ERROR_WITHIN_S]
    assert not late, (late, served.tail())
    print(f"clients' errors {min(o.error_at for o in outcomes) - killed_at:.1f} to "
          f"{max(o.error_at for o in outcomes) - killed_at:.1f} s after the kill: "
          f"{outcomes[0].error}")
    assert not readiness[-1], readiness  # tritonserver is down: serve is starting it again
    # A race inside Triton decides which comes first: serve sees the dead stub and kills
    # tritonserver, or Triton's python backend aborts by itself on the dead stub's lock
    # (boost::interprocess::lock_exception, seen in CI). Either must end in a restart.
    log = served.text()
    assert ("serve: backend stub died: llm_0_0 (model llm" in log
            or "serve: tritonserver crashed (SIGABRT) while serving" in log), served.tail()
    deadline = time.monotonic() + 30  # serve reaps the old server's group first
    while "--health-check: starting tritonserver again" not in served.text():
        assert time.monotonic() < deadline, served.tail()
        time.sleep(0.2)

    print(f"ready again in {served.wait_ready():.1f} s")
    assert served.tritonserver_pid() != first_server
    again = asyncio.run(run_streams(served.grpc, streams(8, forced=False)[:2]))
    assert all(o.error is None and o.final and o.text for o in again), again
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(60) == 0, served.tail()
