"""The prepacked (oneDNN) linear path must see a bounded set of row counts.

oneDNN JITs one primitive (~0.5 MB) per weight shape and row count and keeps up to 1024
of them in each of two caches (ideep's LRU_CACHE_CAPACITY and ONEDNN_PRIMITIVE_CACHE_CAPACITY).
A served engine's steps see nearly every token count up to max_num_batched_tokens as
requests arrive over time, which grew the Triton stub by ~30 MB per burst of 100
requests, to 1-2 GB; kernels/cpu/onednn.py pads rows to a few buckets instead."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import LinearWeight, dispatch
from kernels.cpu.onednn import can_prepack

pytestmark = pytest.mark.timeout(300)


def test_prepacked_linear_sees_few_row_counts_and_keeps_results(monkeypatch):
    seen: set[int] = set()

    def fake_pointwise(x, packed, bias, attr, scalars, algorithm):
        seen.add(x.shape[0])
        return F.linear(x, packed, bias)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", fake_pointwise, raising=False)
    weight, bias = torch.randn(24, 16), torch.randn(24)
    for rows in range(1, 1025):
        x = torch.randn(rows, 16)
        # "packed": the fake takes a plain weight
        out = dispatch.linear(x, LinearWeight(weight, bias, packed=weight))
        assert out.shape == (rows, 24)
        torch.testing.assert_close(out, F.linear(x, weight, bias))
    assert len(seen) <= 64, f"{len(seen)} distinct row counts reached oneDNN for 1..1024 rows"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_prepacked_linear_memory_stays_bounded_over_many_row_counts():
    weight = torch.randn(40, 24)  # a shape no other test packs: every primitive is new here
    if not can_prepack(weight):
        pytest.skip("no oneDNN prepacking on this CPU")
    prepared = dispatch.prepare_linear(weight, None)

    def anon_mib() -> float:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("RssAnon"))
        return int(line.split()[1]) / 1024

    before = anon_mib()
    with torch.inference_mode():
        for rows in range(1, 513):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(dispatch.linear(x, prepared), F.linear(x, weight),
                                       atol=1e-4, rtol=1e-4)
    grown = anon_mib() - before
    # Unbucketed: ~512 primitives, ~250 MB here; bucketed: ~56, ~30 MB.
    assert grown < 100, f"512 row counts grew the process by {grown:.0f} MiB"


def test_built_primitives_leave_nothing_to_create_while_serving(capfd):
    """build_primitives (the engine's warm-up) creates every bucket's primitive up front,
    so serving every row count afterwards only finds them in oneDNN's cache. Read from
    oneDNN's own creation log (cache_miss: built now; cache_hit: found), since memory
    figures after other tests mix in what they freed and what the full cache evicts."""
    import ctypes

    from kernels.cpu import onednn

    weights = [torch.randn(56, 36), torch.randn(36, 56)]  # shapes no other test packs
    if not can_prepack(weights[0]):
        pytest.skip("no oneDNN prepacking on this CPU")
    packed = [onednn.prepack(w) for w in weights]
    libc = ctypes.CDLL(None)

    def creations(run) -> tuple[int, int]:
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            run()
        libc.fflush(None)  # oneDNN prints through C's buffered stdout
        out = capfd.readouterr().out
        return out.count("create:cache_miss"), out.count("create:cache_hit")

    def serve() -> None:
        for rows in range(1, 513):
            for w, p in zip(weights, packed):
                x = torch.randn(rows, w.shape[1])
                torch.testing.assert_close(onednn.linear(x, p, None), F.linear(x, w),
                                           atol=1e-4, rtol=1e-4)

    with torch.inference_mode():
        built, _ = creations(lambda: [onednn.build_primitives(w, p, None, 1, 512)
                                      for w, p in zip(weights, packed)])
        missed, found = creations(serve)
    assert built == 2 * len(onednn.bucket_rows(1, 512))
    assert missed == 0 and found == 2 * 512


def test_the_engines_warm_up_builds_every_matmul_its_steps_can_reach(monkeypatch, tmp_path):
    """Each layer's matmul up to a step's tokens, the lm_head up to a step's sequences."""
    from engine import LLM
    from engine.models.layers import Linear
    from testing.tiny_model import make_tiny_model_dir

    asked: list[list] = []
    real = dispatch.build_matmul_primitives

    def spy(weights):
        weights = list(weights)
        asked.append(weights)
        return real(weights)
    monkeypatch.setattr(dispatch, "build_matmul_primitives", spy)
    llm = LLM(str(make_tiny_model_dir(tmp_path, arch="llama", seed=2)), dtype="bfloat16",
              max_num_batched_tokens=96, max_num_seqs=5, num_kv_blocks=64, max_model_len=128)
    model = llm.llm_engine.runner.model
    layers = [m.prepared for m in model.modules() if isinstance(m, Linear)]
    assert len(asked) == 1 and len(layers) == 4 * 2  # qkv, o, gate_up, down; 2 layers
    assert [(id(w), rows) for w, rows in asked[0]] == (
        [(id(w), 96) for w in layers] + [(id(model.lm_head_prepared), 5)])
