"""Triton's HTTP port under a descriptor flood (issue 43): tritonserver's open-file limit
lowered to a few hundred, more connections opened than it allows. While they are held,
Triton's HTTP server fails accept() in a loop and logs each failure: the log relay
(backend/log_relay.py) keeps the log bounded. Once they close, health answers again."""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.request

import pytest

from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer

pytestmark = pytest.mark.slow
LIMIT, CONNECTIONS, HOLD_S = 200, 400, 6.0


def _live(server: TritonServer) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/live", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_exhausted_descriptors_keep_the_log_bounded_and_health_comes_back(tmp_path):
    log = tmp_path / "tritonserver.log"
    server = TritonServer(REPO_ROOT / "model_repository", ServerPorts.free(), log_path=log,
                          extra_args=["--model-control-mode=explicit"])
    server.start()
    held: list[socket.socket] = []
    try:
        server.wait_ready(timeout=120)
        subprocess.run(["prlimit", f"--nofile={LIMIT}:{LIMIT}", f"--pid={server.process.pid}"],
                       check=True)
        before = log.stat().st_size
        for _ in range(CONNECTIONS):
            s = socket.socket()
            s.settimeout(5)
            try:
                s.connect(("127.0.0.1", server.ports.http))
            except OSError:
                s.close()
                continue
            held.append(s)
        time.sleep(HOLD_S)
        grown = log.stat().st_size - before
        text = log.read_text(errors="replace")
        assert "Too many open files" in text, text[-2000:]  # the flood happened
        # Unfolded, Triton wrote tens of MB a second here; folded, a line per 5 s.
        assert grown < 64 * 1024, grown
    finally:
        for s in held:
            s.close()
    try:
        deadline = time.monotonic() + 60
        while not _live(server):
            assert server.process.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "health never answered after the sockets closed"
            time.sleep(0.5)
    finally:
        server.stop()
