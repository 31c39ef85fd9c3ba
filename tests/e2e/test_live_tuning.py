"""Tuning the live server (python -m tuning.tune --server) through a real tritonserver in
explicit model-control mode: a recorded load on a deliberately narrow setting
(max_num_seqs=1), a refused --apply (the held-out error bound), an --apply while
requests stream (Triton's load with a config override), the applied knobs in the
model's config, the new trace's header and vllm:cache_config_info, every streaming
request complete. (--rollback loads through the same call; each load costs ~35 s here,
so its own logic is tested in tests/tuning/test_live.py.)"""
from __future__ import annotations

import re
import shutil
import threading
import time

import pytest

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT
from tests.e2e.shared import PROMPTS, TINY_ENGINE_ARGS, running_server
from tests.e2e.triton_clients import infer_many, infer_one, llm_inputs, scrape_metrics
from tuning.apply import Repository, as_parameter, parameters
from tuning.trace_file import read_trace
from tuning.tune import main as tune

pytestmark = pytest.mark.slow

MODEL = "llm_live"
STREAM_TOKENS = 24
START = {"max_num_seqs": "1", "num_kv_blocks": "128"}
SLO = ["--slo-ttft-p99", "0.02", "--slo-itl-p99", "0.05"]


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("triton-live")
    params = {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS, **START,
              "trace_path": str(work / "trace.jsonl")}
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=[],
                           renames={MODEL: "llm"}, params={MODEL: params})
    with running_server(repo, work, load=[MODEL]) as handle:
        yield handle, work


def sampling(tokens: int) -> dict:
    return {"temperature": 0, "max_tokens": tokens, "min_tokens": tokens}


class StreamingLoad:
    """Clients that each stream one request after another until stopped."""

    def __init__(self, grpc_url: str, clients: int = 3) -> None:
        self.outcomes: list = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(grpc_url, i))
                         for i in range(clients)]

    def _client(self, url: str, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = PROMPTS[(index + n) % len(PROMPTS)]
            tensors = llm_inputs(prompt, sampling(STREAM_TOKENS), stream=True,
                                 exclude_input_in_output=True, return_num_output_tokens=True)
            self.outcomes.append(infer_one(url, MODEL, tensors, timeout=120))
            n += 1

    def __enter__(self) -> "StreamingLoad":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)


def tokens_of(outcome) -> int:
    return sum(int(r["num_output_tokens"].sum()) for r in outcome.responses
               if "num_output_tokens" in r)


def test_apply_reloads_with_the_recommended_knobs_and_loses_no_request(live, tmp_path, capsys):
    handle, work = live
    server = ["--server", handle.http_url, "--model", MODEL, *SLO, "--quiet",
              "--saved-config", str(tmp_path / "previous.json")]
    with Repository(handle.http_url) as repo:
        check_apply(handle, work, tmp_path, capsys, server, repo)


def check_apply(handle, work, tmp_path, capsys, server, repo):
    before = parameters(repo.config(MODEL))
    # the recorded load: bursts of mixed lengths, queued behind max_num_seqs=1
    for burst in range(2):
        infer_many(handle.grpc_url, MODEL, [
            llm_inputs(PROMPTS[i % len(PROMPTS)] * (1 + i % 3), sampling(8 + 4 * (i % 4)))
            for i in range(10)])
    recorded = read_trace(before["trace_path"])
    assert len(recorded.requests) == 20 and recorded.engine_args["max_num_seqs"] == 1
    # The tool searches on this much (a snapshot beside the live trace, as --trace
    # reads it): what the streams below add would only make the search slower.
    snapshot = work / "recorded.jsonl"
    shutil.copyfile(before["trace_path"], snapshot)
    server += ["--trace", str(snapshot)]

    with pytest.raises(SystemExit) as refused:
        tune([*server, "--apply", "--max-step-error", "0"])
    assert refused.value.code == 2
    assert "refusing to apply" in capsys.readouterr().out
    assert parameters(repo.config(MODEL)) == before

    with StreamingLoad(handle.grpc_url) as load:
        time.sleep(1.0)  # requests in flight when the load begins
        with pytest.raises(SystemExit) as applied:
            tune([*server, "--apply", "--max-step-error", "100", "--window", "3"])
        time.sleep(0.5)
    out = capsys.readouterr().out
    assert applied.value.code == 0, out
    changes = dict(item.split("=", 1)
                   for item in re.search(r"^applying (.*?) \(previous", out, re.M).group(1).split())
    assert "max_num_seqs" in changes or "max_num_batched_tokens" in changes, out
    assert re.search(r"^TTFT p99 s\s+[\d.e+-]+\s+[\d.e+-]+", out, re.M), out  # the comparison

    # none lost: every stream, before, during and after the reload, ran to its end
    assert len(load.outcomes) >= 6
    assert [o.error for o in load.outcomes if o.error] == []
    assert all(o.final and tokens_of(o) == STREAM_TOKENS for o in load.outcomes)

    after = parameters(repo.config(MODEL))
    assert {k: after[k] for k in changes} == changes
    assert after["trace_path"] != before["trace_path"]
    header = read_trace(after["trace_path"]).engine_args
    assert {k: as_parameter(header[k]) for k in changes} == changes
    # streams ran on both instances (the old trace is kept, not truncated by the reload)
    old_streams = [r for r in read_trace(before["trace_path"]).requests
                   if r["output_len"] == STREAM_TOKENS]  # the recorded load asked for <= 20
    new_streams = [r for r in read_trace(after["trace_path"]).requests
                   if r["output_len"] == STREAM_TOKENS]
    assert old_streams and new_streams
    blocks = after.get("num_kv_blocks", before["num_kv_blocks"])
    deadline = time.monotonic() + 20
    while not any(k.startswith("vllm:cache_config_info") and f'model="{MODEL}"' in k
                  and f'num_gpu_blocks="{blocks}"' in k
                  for k in scrape_metrics(handle.metrics_url)):
        assert time.monotonic() < deadline, "vllm:cache_config_info lacks the applied pool"
        time.sleep(0.5)
