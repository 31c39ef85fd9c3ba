"""Workload traces (engine/metrics/trace.py) and their replay on the real scheduler (tuning/)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from testing.tiny_model import make_tiny_model_dir
from engine.core.scheduler import Scheduler
from tuning.replay import configs, kv_layout_of, measured, replay, synthetic_prompts
from tuning.step_model import FEATURES, StepModel, fit, held_out_error, step_durations
from tuning.trace_file import Trace, read_trace

SYSTEM = "You are a terse assistant. Answer in one line. " * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("trace"), arch="llama", seed=4))


def record(tiny, path, **args):
    engine = LLMEngine(EngineConfig.from_dict({"model": tiny, "dtype": "float32",
                                               "num_kv_blocks": 128, "block_size": 8,
                                               "max_model_len": 256, "trace_path": str(path),
                                               **args}))
    prompts = [SYSTEM + "Name a colour.", SYSTEM + "Name a fruit.", "Hello there, how are",
               SYSTEM + "Name a city.", "A completely different prompt that shares nothing"]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6 + i, ignore_eos=True))
    engine.step()
    engine.abort_request("r4")
    while engine.has_unfinished_requests():
        engine.step()
    engine.trace.close()
    return engine, prompts


def test_trace_records_requests_and_steps_without_text(tiny, tmp_path):
    path = tmp_path / "trace.jsonl"
    engine, prompts = record(tiny, path)
    text = path.read_text()
    assert "colour" not in text and "Hello" not in text  # never the prompts
    trace = read_trace(path)
    assert trace.header["block_size"] == 8 and trace.header["engine_args"]["max_num_seqs"] == 64
    by_id = {r["id"]: r for r in trace.requests}
    assert sorted(by_id) == ["r0", "r1", "r2", "r3", "r4"]
    tok = engine.tokenizer
    for i, prompt in enumerate(prompts):
        assert by_id[f"r{i}"]["prompt_len"] == len(tok.encode(prompt))
    for i in range(4):
        r = by_id[f"r{i}"]
        assert r["output_len"] == 6 + i and r["finish_reason"] == "length" and r["cancel"] is None
        assert r["arrival"] <= r["first_token"] <= r["finish"]
    assert by_id["r4"]["cancel"] is not None and by_id["r4"]["finish_reason"] == "abort"
    # the system prompt's blocks are the same chain in r0, r1, r3; r2 shares nothing
    shared = len(tok.encode(SYSTEM)) // 8
    assert shared >= 4
    assert by_id["r0"]["block_hashes"][:shared - 1] == by_id["r1"]["block_hashes"][:shared - 1]
    assert not set(by_id["r2"]["block_hashes"]) & set(by_id["r0"]["block_hashes"])
    # steps: the prompt tokens computed and the decodes add up
    computed = sum(s["prefill_tokens"] for s in trace.steps)
    prompt_tokens = sum(r["prompt_len"] - r["num_cached_tokens"] for r in trace.requests)
    assert computed == prompt_tokens
    first_tokens = sum(1 for r in trace.requests if r["first_token"] is not None)
    decodes = sum(s["decode_tokens"] for s in trace.steps)
    assert decodes == sum(r["output_len"] for r in trace.requests) - first_tokens
    assert all(s["wall"] > 0 and s["batch_size"] >= 1 for s in trace.steps)


def test_trace_is_size_capped_and_read_across_the_rotation(tiny, tmp_path):
    path = tmp_path / "small.jsonl"
    record(tiny, path, trace_max_bytes=1024)
    rotated = path.with_name(path.name + ".1")
    assert rotated.exists() and rotated.stat().st_size < 1024 + 1024
    first = json.loads(path.read_text().splitlines()[0])
    assert first["type"] == "header"  # each part starts with the header
    assert read_trace(path).steps  # both parts, in time order


def test_step_model_recovers_a_known_cost():
    rng = np.random.default_rng(0)
    truth = {"prefill_tokens": 50e-6, "decode_tokens": 300e-6, "context_tokens": 2e-6,
             "num_prefills": 500e-6}
    samples = []
    for _ in range(400):
        f = {"prefill_tokens": int(rng.integers(0, 512)), "decode_tokens": int(rng.integers(0, 64)),
             "context_tokens": int(rng.integers(0, 20000)), "num_prefills": int(rng.integers(0, 4))}
        seconds = 0.004 + sum(truth[k] * f[k] for k in FEATURES)
        samples.append((f, seconds * rng.normal(1.0, 0.02)))
    model, error = held_out_error(samples)
    assert abs(model.intercept - 0.004) < 0.001
    for name, value in truth.items():
        assert model.coefficients[name] == pytest.approx(value, rel=0.1)
    assert error["mape"] < 0.05


def synthetic_trace(num_kv_blocks=256, spacing=0.01, **extra) -> Trace:
    args = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "max_model_len": 64,
            "long_prefill_token_threshold": 0, "policy": "fcfs", "block_size": 4,
            "num_kv_blocks": num_kv_blocks, "enable_prefix_caching": True, "watermark": 0.0,
            "kv_cache_memory_bytes": None, **extra}
    header = {"type": "header", "block_size": 4, "kv_bytes_per_token": 1024, "engine_args": args}
    requests = []
    for i in range(6):
        shared = [111, 222, 333] if i % 2 == 0 else []  # three 4-token blocks in common
        requests.append({"id": f"q{i}", "arrival": spacing * i, "prompt_len": 20,
                         "block_hashes": shared + [1000 + 10 * i + j for j in range(5 - len(shared))],
                         "max_tokens": 8, "min_tokens": 0, "priority": 0, "output_len": 8,
                         "cancel": None})
    return Trace(header, requests, [])


CONSTANT = StepModel(0.001, {name: 0.0 for name in FEATURES}, 0.001)


def test_replay_reproduces_sharing_lengths_and_the_clock():
    trace = synthetic_trace()
    prompts = synthetic_prompts(trace)
    assert prompts[0][:12] == prompts[2][:12] and prompts[0][12:16] != prompts[2][12:16]
    assert not set(prompts[1]) & set(prompts[3])
    result = replay(trace, CONSTANT)
    assert result.requests == 6 and result.preemptions == 0
    # each request: prefill in its arrival step, then 7 more steps of 1 ms
    assert result.e2e["p50"] == pytest.approx(0.008, abs=0.0015)
    assert result.ttft["p50"] == pytest.approx(0.001, abs=0.0011)
    assert result.itl["p50"] == pytest.approx(0.001, abs=1e-6)
    assert result.prefix_hit_rate == pytest.approx(2 * 12 / (6 * 20))  # q2, q4 hit 12 tokens
    no_cache = replay(trace, CONSTANT, {"enable_prefix_caching": "false"})
    assert no_cache.prefix_hit_rate == 0


def test_replay_follows_the_settings_it_is_given():
    trace = synthetic_trace(spacing=0.0005)  # arriving faster than one is served
    one_at_a_time = replay(trace, CONSTANT, {"max_num_seqs": "1"})
    batched = replay(trace, CONSTANT)
    assert one_at_a_time.queue["p90"] > batched.queue["p90"]
    assert one_at_a_time.output_tokens_per_s < batched.output_tokens_per_s
    tight = replay(synthetic_trace(num_kv_blocks=20, spacing=0.0005), CONSTANT)
    assert tight.preemptions > 0 and tight.requests == 6
    with pytest.raises(ValueError, match="not a scheduler or cache argument"):
        replay(trace, CONSTANT, {"max_num_seq": "4"})


def test_replay_sizes_and_allocates_as_the_recorded_kv_groups():
    """A trace of a hybrid model (windowed and full layers) replays on the same KV-cache
    groups: a block holds group_size layers (twice the blocks of the same bytes as one
    full group of 4 layers), admission counts every group's blocks, and blocks behind the
    window are freed during the run."""
    windows = [8, None, 8, None]
    full = synthetic_trace(num_kv_blocks=20)
    hybrid = synthetic_trace(num_kv_blocks=20)
    hybrid.header["kv_layer_windows"] = windows
    pool = {"kv_cache_memory_bytes": str(20 * 4 * 1024)}
    assert configs(full, pool)[1].num_kv_blocks == 20
    assert configs(hybrid, pool)[1].num_kv_blocks == 40
    # max_model_len 64 in blocks of 4: 16 for the full group, 16 more for the windowed
    # one (a 64-token chunk spans the whole request): 20 blocks serve the full layout only.
    with pytest.raises(ValueError, match="cannot hold one request"):
        configs(hybrid, {})
    assert kv_layout_of(full) is None and kv_layout_of(hybrid).num_groups == 2
    peaks = []
    original = Scheduler.schedule

    def schedule(self):
        out = original(self)
        pool = self.kv_cache_manager.block_pool
        peaks.append(pool.num_blocks - pool.num_free_blocks)
        return out

    roomy = synthetic_trace(num_kv_blocks=64, max_num_batched_tokens=8)
    roomy.header["kv_layer_windows"] = windows
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "schedule", schedule)
        result = replay(roomy, CONSTANT, {"max_num_seqs": "1"})
    assert result.requests == 6 and result.preemptions == 0
    # One 28-token request at a time: 7 full-group blocks + at most 4 windowed ones
    # ((8 + 8 - 2) // 4 + 2): more than one group's 7, under the 14 of two unwindowed.
    assert 7 < max(peaks) <= 11


def test_replay_of_a_recorded_trace_matches_its_work(tiny, tmp_path):
    """Under the recorded settings the replay schedules the same work: the same requests,
    output tokens and prefix hits (times are compared by the benchmark, not here)."""
    path = tmp_path / "trace.jsonl"
    record(tiny, path)
    trace = read_trace(path)
    assert trace.header["kv_layer_windows"] == [None] * 2  # the tiny Llama: one full group
    model = fit(step_durations(trace)) if len(trace.steps) > 5 else CONSTANT
    predicted, actual = replay(trace, model), measured(trace)
    assert predicted.requests == actual.requests
    assert predicted.prefix_hit_rate == pytest.approx(actual.prefix_hit_rate)
    assert predicted.preemptions == actual.preemptions == 0
    # the command line writes every request's replayed times
    from tuning.replay import main
    out = tmp_path / "replay.json"
    main([str(path), "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["summary"]["requests"] == 5 and len(written["requests"]) == 5
    first = written["requests"]["r0"]
    assert first["arrival"] <= first["first_token"] <= first["finish"]


def test_tuner_finds_a_setting_that_meets_the_target(tmp_path):
    from tuning.tune import Slo, plot, report, search
    trace = synthetic_trace(spacing=0.0005, max_num_seqs=1)  # recorded one at a time
    model = StepModel(0.001, {"prefill_tokens": 1e-5, "decode_tokens": 1e-4,
                              "context_tokens": 0.0, "num_prefills": 0.0}, 0.001)
    slo = Slo(ttft_p99=0.01, itl_p99=0.01)
    evaluations = search(trace, model, slo, log=lambda _: None)
    text, chosen = report(trace, evaluations, slo)
    recorded = evaluations[0]
    assert recorded.settings["max_num_seqs"] == 1 and recorded.capacity == 0  # misses it
    assert chosen.capacity > 0 and chosen.settings["max_num_seqs"] >= 8
    assert slo.met(chosen.at_recorded)
    assert "recommended: " in text and "max_num_seqs=" in text
    png = tmp_path / "frontier.png"
    plot(evaluations, chosen, slo, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_and_tuner_take_admission_and_the_fair_policy():
    from tuning.tune import knobs
    tight = synthetic_trace(num_kv_blocks=20, spacing=0.0005)
    eager = replay(tight, CONSTANT)
    safe = replay(tight, CONSTANT, {"admission": "no_evict"})
    assert eager.preemptions > 0 and safe.preemptions == 0 and safe.requests == 6
    assert safe.queue["p90"] > eager.queue["p90"]  # it waits for room instead
    for i, record in enumerate(tight.requests):
        record["tenant"] = "heavy" if i else "light"
    fair = replay(tight, CONSTANT, {"policy": "fair"})
    assert fair.requests == 6
    assert dict(knobs(tight))["policy"] == ("fcfs", "fair")
    assert dict(knobs(tight))["admission"] == ("max_utilization", "no_evict")
    assert "policy" not in dict(knobs(synthetic_trace()))  # one tenant, one priority


def test_the_tuning_package_needs_no_torch():
    import subprocess
    import sys
    code = ("import sys, tuning.replay, tuning.tune, tuning.step_model, tuning.workload, "
            "tuning.live; "
            "assert not {'torch', 'triton', 'kernels'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True)
