"""bench/bench_lora_ab.py: both sides build (from a git revision and the working tree),
run the same layers, and the report gives the largest difference between their updates:
none for the same source, the change's size for a changed one."""
import tempfile
from pathlib import Path

import torch

from bench import bench_lora_ab as ab
from bench.native_ab import ROOT, build, source_at

# Where the kernel adds a float32 update to y: the "changed" side adds one more.
STORE = "const vf v = loadf(y) + acc[r][j];"


def _report(new_text_of) -> str:
    texts = {"old": source_at("HEAD", ab.SOURCE),
             "new": new_text_of((ROOT / ab.SOURCE).read_text())}
    weight_args = {side: ab.signature(text) for side, text in texts.items()}
    with tempfile.TemporaryDirectory() as tmp:
        fns = {side: ab.bind(build(text, Path(tmp), f"{side}_lora"), weight_args[side])
               for side, text in texts.items()}
        return ab.run_case(fns, weight_args, "tiny", torch.float32, rows=12, rank=4,
                           threads=1, repeats=1, decoder_layers=2)


def test_the_report_gives_the_largest_difference_between_the_sides(monkeypatch):
    monkeypatch.setitem(ab.MODELS, "tiny", (32, 32, 16, 48, 2))
    assert ab.layer_shapes("tiny") == [(32, (32, 16, 16)), (32, (32,)), (32, (48, 48)),
                                       (48, (32,))]
    weights = ab.fused_weights(32, (32, 16, 16), 4, torch.float32, torch.Generator())
    assert weights.rank_spans.tolist() == [[0, 4], [0, 4], [4, 8], [8, 12]]  # block-diagonal
    line = _report(lambda text: text)
    assert line.startswith("tiny") and line.endswith("max diff / max update 0.0e+00")

    def changed(text: str) -> str:
        assert STORE in text
        return text.replace(STORE, STORE.replace("acc[r][j];", "acc[r][j] + 1.f;"))
    assert not _report(changed).endswith("0.0e+00")
    # A library linked with -ffast-math switches on flush-to-zero for the whole process.
    assert (torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() != 0.0

