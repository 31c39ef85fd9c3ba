"""The soak bench's tritonserver: three copies of `llm` with different admission settings,
their gauges and counters, and the memory of the whole server process group."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer

MAIN, SMALL_QUEUE, PROBE = "llm", "llm_small_queue", "llm_probe"
# Bench-local, so a test tuning its own arguments never changes these figures. fp32 keeps
# greedy argmax batch-invariant on the tiny random weights (the e2e tests rely on it too).
TINY_ARGS = {"dtype": "float32", "block_size": "16", "num_kv_blocks": "512", "max_num_seqs": "64",
             "max_model_len": "512", "max_num_batched_tokens": "1024"}
DEFAULT_ARGS = {"dtype": "auto", "block_size": "16", "num_kv_blocks": "512", "max_num_seqs": "64",
                "max_model_len": "1024", "max_num_batched_tokens": "1024"}
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
REJECTED = "vllm:admission_rejections_total"


@dataclass(slots=True)
class ModelSpec:
    label: str  # "tiny" | "default"
    path: str  # the `model` parameter; "" = the embedded SmolLM2
    engine_args: dict[str, str]


@dataclass(slots=True)
class ServerPlan:
    spec: ModelSpec
    main_queue_len: int
    overload_queue_len: int
    probe_queue_len: int
    probe_max_model_len: int
    models: list[str] = field(default_factory=lambda: [MAIN, SMALL_QUEUE, PROBE])

    def parameters(self) -> dict[str, dict[str, str]]:
        base = {"model": self.spec.path, **self.spec.engine_args}
        return {
            MAIN: {**base, "MAX_QUEUE_LEN": str(self.main_queue_len)},
            SMALL_QUEUE: {**base, "MAX_QUEUE_LEN": str(self.overload_queue_len),
                          "max_num_seqs": str(min(int(base["max_num_seqs"]), self.overload_queue_len))},
            # One running sequence: whatever arrives after the probe stays WAITING.
            PROBE: {**base, "max_num_seqs": "1",
                    "max_model_len": str(self.probe_max_model_len),
                    "MAX_QUEUE_LEN": str(self.probe_queue_len)},
        }


@dataclass(slots=True)
class Gauges:
    kv_usage: float
    running: float
    waiting: float

    @property
    def idle(self) -> bool:
        return self.kv_usage == 0 and self.running == 0 and self.waiting == 0


class SoakServer:
    """Starts on enter, stops on exit; the log stays in a temp folder for a post-mortem."""

    def __init__(self, plan: ServerPlan) -> None:
        self.plan = plan
        self.work = Path(tempfile.mkdtemp(prefix="soak-"))
        repo = copy_repository(REPO_ROOT / "model_repository", self.work / "models", models=[],
                               renames={name: "llm" for name in plan.models},
                               params={name: p for name, p in plan.parameters().items()
                                       if name in plan.models})
        self.log_path = self.work / "tritonserver.log"
        self.handle = TritonServer(repo, ServerPorts.free(), log_path=self.log_path,
                                   extra_args=["--model-control-mode=explicit", "--log-verbose=0",
                                               "--exit-timeout-secs=15",
                                               *[f"--load-model={name}" for name in plan.models]])
        self.ready_s = 0.0

    def __enter__(self) -> "SoakServer":
        self.handle.start()
        try:
            self.ready_s = self.handle.wait_ready(timeout=900)
        except BaseException:
            self.handle.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.handle.stop()
        shutil.rmtree(self.work / "models", ignore_errors=True)  # the log stays

    @property
    def grpc_url(self) -> str:
        return self.handle.grpc_url

    def alive(self) -> bool:
        return self.handle.process is not None and self.handle.process.poll() is None \
            and self.handle.is_ready()

    def _metrics_text(self) -> str:
        with urllib.request.urlopen(self.handle.metrics_url, timeout=10) as response:
            return response.read().decode()

    def _value(self, text: str, name: str, model: str) -> float:
        # One series per model instance (its `engine` label), and per label value of a
        # labelled family; the model's value is their sum.
        pattern = re.escape(name) + r'\{[^}]*\bmodel="' + re.escape(model) + r'"[^}]*\} (\S+)$'
        found = re.findall(pattern, text, re.MULTILINE)
        if not found:
            raise RuntimeError(f"{name} for {model} not exported")
        return sum(float(value) for value in found)

    def gauges(self, model: str) -> Gauges:
        text = self._metrics_text()
        return Gauges(*(self._value(text, name, model) for name in GAUGES))

    def rejected(self, model: str) -> float:
        return self._value(self._metrics_text(), REJECTED, model)

    def wait_until(self, model: str, predicate, timeout: float) -> tuple[Gauges, float]:
        """Polls the gauges until predicate(gauges); returns the last gauges and seconds waited.
        Gauges are recorded once per engine step, so they lag the engine by a step."""
        start = time.monotonic()
        while True:
            gauges = self.gauges(model)
            waited = time.monotonic() - start
            if predicate(gauges) or waited > timeout:
                return gauges, waited
            time.sleep(0.1)

    def wait_rejected(self, model: str, at_least: float, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while (value := self.rejected(model)) < at_least and time.monotonic() < deadline:
            time.sleep(0.1)
        return value

    def group_rss_bytes(self) -> int:
        """tritonserver plus its python backend stubs: every process of its process group."""
        pgid = self.handle.process.pid
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                # Fields after the parenthesised command: state ppid pgrp ...
                if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
                for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
        return total
