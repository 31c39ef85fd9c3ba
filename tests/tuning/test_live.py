"""The live tuner's pieces that need no server: trace naming and reading a trace being
written, which knobs changed, and --rollback (tuning/live.py) against a stand-in for
Triton's repository endpoints. Through the real tritonserver: tests/e2e/test_live_tuning.py."""
from __future__ import annotations

import json

import pytest

from tuning.apply import changed_arguments, load_previous, parameters, save_previous
from tuning.live import rollback
from tuning.server_trace import local_path, next_trace_path, trace_path_of
from tuning.trace_file import read_trace


def test_each_load_gets_a_new_trace_beside_the_old_one():
    first = next_trace_path("/srv/traces/llm.jsonl", "20261202T030000")
    assert first == "/srv/traces/llm.tuned-20261202T030000.jsonl"
    second = next_trace_path(first, "20261202T040000")
    assert second == "/srv/traces/llm.tuned-20261202T040000.jsonl"  # one tag, the newest
    assert str(local_path(first, "/mnt/x/llm.jsonl")) == "/mnt/x/llm.tuned-20261202T030000.jsonl"
    with pytest.raises(ValueError, match="trace_path"):
        trace_path_of({"parameters": {"max_num_seqs": {"string_value": "8"}}}, "llm")


def test_a_live_traces_half_written_last_line_is_left_for_later(tmp_path):
    path = tmp_path / "t.jsonl"
    step = {"type": "step", "start": 0.0, "wall": 0.01, "prefill_tokens": 4}
    path.write_text(json.dumps({"type": "header", "block_size": 4}) + "\n" + json.dumps(step)
                    + "\n" + json.dumps(step)[:20])
    assert len(read_trace(path).steps) == 1
    path.write_text(json.dumps(step)[:20] + "\n" + json.dumps(step) + "\n")
    with pytest.raises(ValueError, match="not a JSON line"):  # a cut inside still fails
        read_trace(path)


def test_only_knobs_that_differ_from_the_running_ones_are_changed():
    running = {"max_num_seqs": 8, "watermark": 0.0, "shield_resumed": False}
    wanted = {"max_num_seqs": "8", "watermark": 0.01, "shield_resumed": True, "policy": "fcfs"}
    assert changed_arguments(running, wanted) == {"watermark": "0.01", "shield_resumed": "true",
                                                  "policy": "fcfs"}


class Repo:
    """Holds one model's config as Triton's model-config endpoint returns it."""

    def __init__(self, config):
        self.current, self.loads = config, []

    def config(self, model):
        return self.current

    def reload(self, model, config):
        self.loads.append(config)
        self.current = config


def config_with(**params):
    return {"name": "llm", "backend": "tle",
            "parameters": {k: {"string_value": v} for k, v in params.items()}}


def test_rollback_loads_the_saved_config_again_with_a_fresh_trace(tmp_path, capsys):
    saved = tmp_path / "previous.json"
    previous = config_with(max_num_seqs="1", trace_path="/t/llm.jsonl")
    save_previous(saved, "llm", previous)
    repo = Repo(config_with(max_num_seqs="16", trace_path="/t/llm.tuned-20261202T030000.jsonl"))
    assert rollback(repo, "llm", saved) == 0
    restored = parameters(repo.loads[-1])
    assert restored["max_num_seqs"] == "1" and repo.loads[-1]["backend"] == "tle"
    assert restored["trace_path"].startswith("/t/llm.tuned-")
    assert restored["trace_path"] not in ("/t/llm.jsonl", "/t/llm.tuned-20261202T030000.jsonl")
    assert "max_num_seqs=1" in capsys.readouterr().out
    with pytest.raises(ValueError, match="'other'"):
        load_previous(saved, "other")
    with pytest.raises(FileNotFoundError, match="nothing was applied"):
        rollback(repo, "llm", tmp_path / "none.json")
