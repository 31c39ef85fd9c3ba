"""bench/bench_gpu.py, the one script a lent GPU runs, proven on CPU: its full flow under
the Triton interpreter (--rehearse), both ways of starting it, and the runner's rule
that every failure, crash or dead child reaches the exit status."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_gpu import build_plan, step_names
from bench.gpu_engine_cases import greedy_verdict
from bench.gpu_report import Case, CaseRunner, ChildJob, Outcome

REPO_ROOT = Path(__file__).resolve().parents[2]


def rows_of(summary: str) -> dict[str, str]:
    """case name -> status, from the table bench_gpu prints last."""
    header, *lines, _totals = summary.splitlines()
    column = header.index("status")
    return {line[:column].strip(): line[column:].split()[0] for line in lines}


@pytest.mark.slow
def test_rehearsal_runs_every_case_and_exits_zero(tmp_path):
    summary_path = tmp_path / "summary.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_gpu", "--rehearse", "--workdir", str(tmp_path),
         "--summary-out", str(summary_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = rows_of(summary_path.read_text())
    expected = step_names(build_plan("cpu", rehearse=True, peak_bytes_per_s=5e10))
    assert list(rows) == expected
    assert rows["KV cache >= 2^31 elements"] == "SKIP"
    assert rows["device cuda:1"] == "SKIP"
    assert rows["head_dim 8 bf16 decode+prefill"] == "PASS"
    assert all(status in ("PASS", "OK", "SKIP") for status in rows.values()), rows
    assert "the interpreter enforces the GPU's tl.dot minimum" in proc.stdout


def test_started_as_a_file_with_a_case_filter(tmp_path):
    # `python3 bench/bench_gpu.py` puts bench/ (not the repo root) on sys.path
    proc = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", "--rehearse", "--cases", "reshape_and_cache",
         "--summary-out", str(tmp_path / "summary.txt")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rows_of((tmp_path / "summary.txt").read_text()) == {
        "reshape_and_cache bf16+fp32": "PASS"}


def test_a_raising_case_fails_alone_and_sets_the_exit_status():
    def broken() -> Outcome:
        raise RuntimeError("kernel exploded\nsecond line")
    runner = CaseRunner("cpu")
    for case in (Case("first", lambda: Outcome("PASS", "fine")), Case("boom", broken),
                 Case("after", lambda: Outcome("SKIP", "nothing to do"))):
        runner.run_case(case)
    assert [(r.name, r.status) for r in runner.results] == [
        ("first", "PASS"), ("boom", "FAIL"), ("after", "SKIP")]
    assert runner.results[1].detail == "RuntimeError: kernel exploded"
    assert runner.exit_code() == 1
    assert runner.summary().splitlines()[-1].startswith("1 PASS, 1 FAIL, 1 SKIP, 0 OK")


def test_measurements_and_skips_alone_exit_zero():
    runner = CaseRunner("cpu")
    runner.run_case(Case("bw", lambda: Outcome("OK", "1.0 TB/s")))
    runner.run_case(Case("two gpus", lambda: Outcome("SKIP", "1 GPU")))
    assert runner.exit_code() == 0


def child_command(results: dict, exit_code: int, out: Path, sleep_s: float = 0.0) -> list[str]:
    script = (f"import json, sys, time; open({str(out)!r}, 'w').write({json.dumps(results)!r}); "
              f"time.sleep({sleep_s}); sys.exit({exit_code})")
    return [sys.executable, "-c", script]


def test_a_child_that_dies_fails_the_cases_it_never_reported(tmp_path):
    out = tmp_path / "child.json"
    reported = {"engine fp32": {"status": "PASS", "detail": "4/4", "seconds": 1.0}}
    runner = CaseRunner("cpu")
    runner.run_child(ChildJob("greedy", ("engine fp32", "engine bf16"), 30),
                     child_command(reported, 3, out), out)
    assert [(r.name, r.status) for r in runner.results] == [
        ("engine fp32", "PASS"), ("engine bf16", "FAIL")]
    assert "child exit 3 before reporting" in runner.results[1].detail
    assert runner.exit_code() == 1


def test_a_child_past_its_timeout_fails_its_cases(tmp_path):
    out = tmp_path / "child.json"
    runner = CaseRunner("cpu")
    runner.run_child(ChildJob("throughput", ("e2e B=1",), 1.0), child_command({}, 0, out, 30), out)
    assert runner.results[0].status == "FAIL"
    assert "timed out after 1s" in runner.results[0].detail


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="status"):
        Outcome("MAYBE", "")


def test_greedy_divergence_passes_only_at_a_near_tie():
    cpu = [([5, 7, 9], [{5: -1.0}, {7: -1.00, 8: -1.02, 3: -2.0}, {9: -1.0}])]
    tie = [([5, 8, 4], [])]       # 8 trailed the CPU's 7 by 0.02
    clear = [([5, 3, 4], [])]     # 3 trailed by 1.0
    unseen = [([5, 6, 4], [])]    # 6 is outside the CPU's top k
    assert greedy_verdict(cpu, tie, near_tie=0.05) == (
        True, "0/1 prompts identical (3 tokens); first divergence p0@1, max margin 0.02")
    assert greedy_verdict(cpu, clear, near_tie=0.05)[0] is False
    assert greedy_verdict(cpu, unseen, near_tie=0.05) == (
        False, "0/1 prompts identical (3 tokens); first divergence p0@1, max margin inf")
    assert greedy_verdict(cpu, [([5, 7], [])], near_tie=0.05)[0] is False  # cut short
    assert greedy_verdict(cpu, [([5, 7, 9], [])], near_tie=0.0) == (
        True, "1/1 prompts identical (3 tokens)")
