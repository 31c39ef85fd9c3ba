"""bench/bench_row_kernels_ab.py: both sides build from a git revision and the working
tree, run the same pass, and the report says whether their outputs are bit-equal; loading
them leaves the process's float state alone (bench/native_ab.py links without fast-math)."""
import tempfile
from pathlib import Path

import pytest
import torch

from bench import bench_row_kernels_ab as ab
from bench.native_ab import ROOT, build, source_at

# Where each kernel stores an output: the "changed" side adds one to every output there.
STORE = {torch.bfloat16: "yr[i] = f32_to_bf16(out[i] + ", torch.float32: "yr[i] = out[i] + "}


def _report(dtype, new_text_of) -> str:
    source, symbol = ab.KERNELS[dtype]
    old_text = source_at("HEAD", source)
    texts = {"old": old_text, "new": new_text_of((ROOT / source).read_text())}
    with tempfile.TemporaryDirectory() as tmp:
        fns = {side: ab.bind(build(text, Path(tmp), f"{side}_{symbol}"), symbol, dtype)
               for side, text in texts.items()}
        return ab.run_case(fns, "tiny", dtype, threads=1, repeats=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_report_says_whether_both_sides_outputs_are_bit_equal(dtype, monkeypatch):
    monkeypatch.setitem(ab.MODELS, "tiny", (2, 64, 96, 128, 256))
    assert ab.token_shapes("tiny") == [(96, 64), (64, 64), (256, 64), (64, 128)] * 2 + [(256, 64)]
    line = _report(dtype, lambda text: text)
    assert line.startswith("tiny") and line.endswith("bit-equal True")

    def changed(text: str) -> str:
        assert STORE[dtype] in text
        return text.replace(STORE[dtype], STORE[dtype] + "1.f + ")
    assert _report(dtype, changed).endswith("bit-equal False")
    # A library linked with -ffast-math switches on flush-to-zero for the whole process.
    assert (torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() != 0.0
