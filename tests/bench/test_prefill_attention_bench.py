"""bench/bench_prefill_attention.py runs every side on each case and reports the AMX
kernel's ratios exactly where it is built (a '-' elsewhere)."""
import sys

from bench import bench_prefill_attention as bench
from kernels.cpu import native as cpu_native
from kernels.cpu import paged_attention as cpu_attention


def test_every_case_gets_a_line_with_every_side(monkeypatch, capsys):
    monkeypatch.setattr(bench, "CASES", [("2 x 40 fresh", [40, 40], [40, 40]),
                                         ("1 x 16 after 64", [80], [16])])
    monkeypatch.setattr(sys, "argv", ["bench", "--shape", "smollm2", "llama-3.2-1b",
                                      "--threads", "1", "--repeat", "1"])
    bench.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if " t1 " in line]
    assert len(lines) == 4
    for line in lines:
        assert "sdpa" in line
        assert ("tiles" in line) == (cpu_native.load_library() is not None)
        assert ("sdpa/amx" in line) == cpu_attention.prefill_amx_built()
