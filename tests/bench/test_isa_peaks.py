"""bench/isa_peaks.py measures exactly the instructions its build carries, as the engine's
build would for this host's level (the capped pass runs it at AVX2)."""
import shutil

import pytest

from bench import isa_peaks
from kernels.cpu import features as cpu_features

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _at_least(level: str) -> bool:
    features = cpu_features.detect()
    levels = cpu_features.X86_LEVELS
    return features.is_x86 and levels.index(features.isa) >= levels.index(level)


def test_each_instruction_is_timed_where_the_level_builds_it(capsys):
    isa_peaks.main(["--iters", "20000", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"host: {cpu_features.detect().describe()}")
    rows = {label: line for line in lines[1:]
            for _, label, _ in isa_peaks.INSTRUCTIONS if line.startswith(label)}
    assert len(rows) == len(isa_peaks.INSTRUCTIONS)
    expected = {"vfmadd231ps ymm (float32)": _at_least("avx2"),
                "vfmadd231ps zmm (float32)": _at_least("avx512"),
                "vdpbf16ps zmm (bf16 pairs)": _at_least("avx512_bf16")}
    for label, built in expected.items():
        figure = rows[label][len(label):].split()[0]
        assert (figure != "-") == built, rows[label]
        if built:
            assert float(figure) > 0
    vnni = rows["vpdpbusd zmm (int8 quads)"][len("vpdpbusd zmm (int8 quads)"):].split()[0]
    if vnni != "-":  # only where the CPU has it, and the level's flags enable it
        assert "avx512_vnni" in cpu_features.detect().flags and float(vnni) > 0


def test_ratio_is_over_the_widest_float32_fma():
    rates = {"fma_256": 100.0, "fma_512": 200.0, "dpbf16_512": 100.0, "dpbusd_512": None}
    lines = isa_peaks.report(rates)
    assert lines[0].endswith("0.50x") and lines[1].endswith("1.00x")
    assert lines[2].endswith("0.50x") and lines[3].split()[-1] == "-"
    # an AVX2 build: the 256-bit FMA is the widest
    lines = isa_peaks.report({"fma_256": 100.0, "fma_512": None, "dpbf16_512": None,
                              "dpbusd_512": None})
    assert lines[0].endswith("1.00x")
