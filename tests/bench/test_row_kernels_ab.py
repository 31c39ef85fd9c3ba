"""bench/bench_row_kernels_ab.py: both sides build from a git revision and the working
tree, run the same pass, and the report says whether their outputs are bit-equal; loading
them leaves the process's float state alone (bench/native_ab.py links without fast-math)."""
import tempfile
from pathlib import Path

import pytest
import torch

from bench import bench_row_kernels_ab as ab
from bench.native_ab import ROOT, build, source_at


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_revision_against_the_working_tree_reports_bit_equal_outputs(dtype, monkeypatch):
    monkeypatch.setitem(ab.MODELS, "tiny", (2, 64, 96, 128, 256))
    source, symbol = ab.KERNELS[dtype]
    with tempfile.TemporaryDirectory() as tmp:
        fns = {}
        for side, text in (("old", source_at("HEAD", source)), ("new", (ROOT / source).read_text())):
            fns[side] = ab.bind(build(text, Path(tmp), f"{side}_{symbol}"), symbol, dtype)
        line = ab.run_case(fns, "tiny", dtype, threads=1, repeats=2)
    assert "tiny" in line and "bit-equal True" in line
    # A library linked with -ffast-math switches on flush-to-zero for the whole process.
    assert (torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() != 0.0
    assert ab.token_shapes("tiny") == [(96, 64), (64, 64), (256, 64), (64, 128)] * 2 + [(256, 64)]
