"""A trace target that cannot be written (a folder, a full disk) switches tracing off with
one log line; the requests being traced get the same tokens as without a trace."""
from __future__ import annotations

import logging
import os

import pytest

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.metrics.trace import NullTrace, TraceRecorder
from testing.tiny_model import make_tiny_model_dir

PROMPTS = ["Hello there, how are", "A completely different prompt", "1, 2, 3,"]
TRACE_LOGGER = "engine.metrics.trace"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("trace-faults"), arch="llama", seed=4))


def generate(tiny, **args) -> tuple[object, dict[str, list[int]]]:
    """The engine's trace as it was before close (close swaps in a NullTrace), and the
    tokens of every request."""
    engine = LLMEngine(EngineConfig.from_dict({"model": tiny, "dtype": "float32",
                                               "num_kv_blocks": 64, "block_size": 8,
                                               "max_model_len": 128, **args}))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    trace = engine.trace
    engine.close()
    return trace, tokens


def trace_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("engine") and r.levelno >= logging.ERROR]


def test_a_folder_as_trace_path_turns_tracing_off_at_start(tiny, tmp_path, caplog):
    _, untraced = generate(tiny)
    with caplog.at_level(logging.ERROR):
        trace, traced = generate(tiny, trace_path=str(tmp_path))  # a folder: open() fails
    assert isinstance(trace, NullTrace)
    assert traced == untraced and len(traced) == len(PROMPTS)
    errors = trace_errors(caplog)
    assert len(errors) == 1 and "tracing switched off" in errors[0] and str(tmp_path) in errors[0]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (ENOSPC on write)")
def test_a_full_disk_mid_run_switches_tracing_off_once(tiny, tmp_path, caplog):
    # A link, so the rotation renames the link and never the device node.
    full = tmp_path / "trace.jsonl"
    full.symlink_to("/dev/full")
    _, untraced = generate(tiny)
    with caplog.at_level(logging.ERROR):
        # The first rotation (its close flushes) or the final close hits ENOSPC.
        trace, traced = generate(tiny, trace_path=str(full), trace_max_bytes=1024)
    assert isinstance(trace, TraceRecorder) and trace.off  # off before the final close
    assert traced == untraced and len(traced) == len(PROMPTS)
    errors = trace_errors(caplog)
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    assert full.is_symlink() and os.path.exists("/dev/full")
