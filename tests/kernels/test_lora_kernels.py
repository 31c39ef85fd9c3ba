"""The segmented LoRA update: the native CPU kernel and the Triton kernel (under
TRITON_INTERPRET=1 without a GPU, tiny shapes) against the torch reference in
kernels/lora_ops.py, with segments of scattered rows, different ranks (a fused layer's
stacked ones included), an adapter without this layer, and rows no segment names."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import dispatch
from kernels.cpu import features as cpu_features
from kernels.cpu import lora as cpu_lora
from kernels.lora_ops import LoRAWeights, lora_add, make_segments

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4),
             torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}
# Three adapters over 23 rows: one in two runs, one absent from this layer, base rows
# (3..5 and 20..22) in none.
RUNS = [[(0, 3), (12, 20)], [(6, 9)], [(9, 12)]]


def _case(dtype, in_features, out_features, ranks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(23, in_features, generator=gen).to(dtype)
    y = torch.randn(23, out_features, generator=gen).to(dtype)
    weights = [None if r is None else
               LoRAWeights.of((torch.randn(r, in_features, generator=gen) * 0.3).to(dtype),
                           (torch.randn(out_features, r, generator=gen) * 0.3).to(dtype))
               for r in ranks]
    return x, y, weights


def _reference(x, y, segments, weights):
    expected = y.clone()
    lora_add(x, expected, segments, weights)
    assert not torch.equal(expected, y)  # the update is not empty
    return expected


@pytest.mark.skipif(cpu_lora._library() is None,
                    reason="no C compiler: the torch path runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 37, 130, 1: the vector loops' tails; segments of 11 and 3 rows: partial row blocks.
@pytest.mark.parametrize("shape", [(64, 48, (16, None, 3)), (37, 130, (48, 8, 1))])
def test_native_kernel_matches_torch(dtype, shape):
    in_features, out_features, ranks = shape
    x, y, weights = _case(dtype, in_features, out_features, ranks)
    segments = make_segments(RUNS)
    expected = _reference(x, y, segments, weights)
    got = y.clone()
    assert cpu_lora.lora_add(x, got, segments, weights)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    untouched = list(range(3, 6)) + list(range(20, 23))
    assert torch.equal(got[untouched], y[untouched])


def test_pack_pairs_puts_two_consecutive_rows_in_one_lane():
    m = torch.arange(1, 3 * 5 + 1, dtype=torch.float32).view(3, 5).to(torch.bfloat16)
    packed = cpu_lora.pack_pairs(m)
    assert packed.shape == (2, cpu_lora.PAIR_LANES, 2) and packed.is_contiguous()
    for p in range(2):
        for n in range(cpu_lora.PAIR_LANES):
            for half in range(2):
                k = 2 * p + half
                expected = m[k, n].item() if k < 3 and n < 5 else 0.0
                assert packed[p, n, half].item() == expected, (p, n, half)


def test_prepare_lora_packs_pairs_where_the_native_kernel_runs_them():
    a, b = torch.randn(4, 10), torch.randn(6, 4)
    assert dispatch.prepare_lora(a, b).pairs is None  # float32
    bf16 = dispatch.prepare_lora(a.bfloat16(), b.bfloat16())
    assert (bf16.pairs is not None) == cpu_lora.runs_pairs()
    assert cpu_lora.runs_pairs() == (cpu_lora._library() is not None and
                                     cpu_features.detect().isa in ("avx512_bf16", "amx"))
    assert torch.equal(bf16.a, a.bfloat16()) and torch.equal(bf16.b, b.bfloat16())


@pytest.mark.skipif(not cpu_lora.runs_pairs(),
                    reason="no AVX512_BF16 build here: bf16 runs as float32 FMAs (above)")
# odd in (37): x's last pair padded; ranks 48, 8, 1 and out 130: padded lanes; spans of a
# fused B below.
@pytest.mark.parametrize("shape", [(64, 48, (16, None, 3)), (37, 130, (48, 8, 1))])
def test_bf16_pairs_match_torch(shape):
    in_features, out_features, ranks = shape
    x, y, plain = _case(torch.bfloat16, in_features, out_features, ranks)
    weights = [None if w is None else dispatch.prepare_lora(w.a, w.b) for w in plain]
    assert all(w is None or w.pairs is not None for w in weights)
    segments = make_segments(RUNS)
    expected = _reference(x, y, segments, weights)
    got = y.clone()
    assert cpu_lora.lora_add(x, got, segments, weights)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.bfloat16])
    untouched = list(range(3, 6)) + list(range(20, 23))
    assert torch.equal(got[untouched], y[untouched])
    # pairs that do not fit the layer are left aside: the plain bf16 path runs
    stale = [None if w is None else replace(w, pairs=(w.pairs[0][:-1], w.pairs[1]))
             for w in weights]
    got_plain, got_stale = y.clone(), y.clone()
    assert cpu_lora.lora_add(x, got_plain, segments, plain)
    assert cpu_lora.lora_add(x, got_stale, segments, stale)
    assert torch.equal(got_stale, got_plain)


def test_native_kernel_declines_what_it_does_not_take():
    x, y, weights = _case(torch.float32, 16, 8, (4, None, 2))
    segments = make_segments(RUNS)
    first, last = weights[0], weights[2]
    assert not cpu_lora.lora_add(x.half(), y.half(), segments, weights)  # dtype
    transposed = replace(first, a=first.a.t())
    assert not cpu_lora.lora_add(x, y, segments, [transposed, None, last])  # shapes
    for layout in (replace(last, a=last.a.contiguous()), replace(last, b=last.b.contiguous()),
                   replace(last, rank_spans=last.rank_spans[:-1])):
        assert not cpu_lora.lora_add(x, y, segments, [first, None, layout])  # A's, B's, spans
    # dispatch falls back to torch for them
    doubles = [None if w is None else LoRAWeights.of(w.a.double(), w.b.double())
               for w in weights]
    got = y.double()
    dispatch.lora_add(x.double(), got, segments, doubles)
    torch.testing.assert_close(got, _reference(x.double(), y.double(), segments, doubles))


def test_rank_spans_name_each_column_blocks_nonzero_ranks():
    """A fused layer's B, block-diagonal over three parts (one of 20 columns that straddles
    a 16-column block, one of 18 the adapter did not train), plus a column past the last
    whole block: each block's span covers exactly the ranks of the parts it touches."""
    b = torch.zeros(50, 12)
    b[:20, 0:4] = 1.0     # part 1: columns 0..19, ranks 0..3
    b[38:49, 4:12] = 2.0  # part 3: columns 38..48, ranks 4..11 (part 2, 20..37, untrained)
    b[49, 7] = 3.0
    spans = LoRAWeights.of(torch.ones(12, 8), b).rank_spans
    assert spans.dtype == torch.int32 and spans.shape == (4, 2)
    assert spans.tolist() == [[0, 4], [0, 4], [4, 12], [4, 12]]
    assert LoRAWeights.of(torch.ones(3, 8), torch.zeros(20, 3)).rank_spans.tolist() == [[0, 0]] * 2
    assert LoRAWeights.of(torch.ones(0, 8), torch.zeros(20, 0)).rank_spans.tolist() == [[0, 0]] * 2


@pytest.mark.skipif(cpu_lora._library() is None,
                    reason="no C compiler: the torch path runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_reads_only_the_spans_ranks(dtype):
    """The expand takes each column block's ranks from rank_spans: a fused B's
    block-diagonal layout matches torch, and ranks a span leaves out are never read (here
    spans that claim nothing for the first part's blocks leave its columns untouched)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(23, 64, generator=gen).to(dtype)
    y = torch.randn(23, 80, generator=gen).to(dtype)
    b = torch.zeros(80, 48)
    b[:48, :16] = torch.randn(48, 16, generator=gen)  # columns 0..47: ranks 0..15
    b[48:, 32:] = torch.randn(32, 16, generator=gen)  # columns 48..79: ranks 32..47 (16..31 idle)
    fused = dispatch.prepare_lora(torch.randn(48, 64, generator=gen).to(dtype) * 0.3,
                                  (b * 0.3).to(dtype))  # bf16 pairs where they run
    assert fused.rank_spans.tolist() == [[0, 16]] * 3 + [[32, 48]] * 2
    segments = make_segments(RUNS)
    weights = [fused, None, fused]
    expected = _reference(x, y, segments, weights)
    got = y.clone()
    assert cpu_lora.lora_add(x, got, segments, weights)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    spans = fused.rank_spans.clone()
    spans[:3] = 0
    blind = replace(fused, rank_spans=spans)
    got = y.clone()
    assert cpu_lora.lora_add(x, got, segments, [blind, None, blind])
    assert torch.equal(got[:, :48], y[:, :48])
    torch.testing.assert_close(got[:, 48:], expected[:, 48:], **TOLERANCE[dtype])


def test_dispatch_runs_the_update_on_a_strided_output():
    """A fused layer's y is one buffer; the update may land on a column slice of it."""
    x, y, weights = _case(torch.float32, 32, 24, (8, 4, None))
    segments = make_segments(RUNS)
    wide = torch.zeros(23, 40)
    wide[:, 8:32] = y
    expected = _reference(x, y, segments, weights)
    dispatch.lora_add(x, wide[:, 8:32], segments, weights)
    torch.testing.assert_close(wide[:, 8:32], expected, **TOLERANCE[torch.float32])


def _in_one_buffer(weights):
    """The same weights as views of one storage (how a pooled loader would hold them)."""
    present = [w for w in weights if w is not None]
    flat = torch.cat([t.reshape(-1) for w in present for t in (w.a.t(), w.b.t())])
    out, at = [], 0
    for w in weights:
        if w is None:
            out.append(None)
            continue
        (rank, in_features), out_features = w.a.shape, w.b.shape[0]
        a_view = flat[at:at + w.a.numel()].view(in_features, rank).t()
        at += w.a.numel()
        b_view = flat[at:at + w.b.numel()].view(rank, out_features).t()
        at += w.b.numel()
        out.append(replace(w, a=a_view, b=b_view))
    return out


@pytest.mark.parametrize("dtype,shared", [(torch.float32, False), (torch.bfloat16, False),
                                          (torch.float32, True)])
def test_triton_kernel_matches_torch(dtype, shared):
    pytest.importorskip("triton")
    from kernels.triton import lora as triton_lora

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # in 40 over block_k 16 and out 36 over block_n 16: partial tiles; rank 20 pads to 32.
    x, y, weights = _case(dtype, 40, 36, (20, None, 5), seed=1)
    segments = make_segments(RUNS)
    expected = _reference(x, y, segments, weights)
    on = [None if w is None else replace(w, a=w.a.to(device), b=w.b.to(device))
          for w in weights]
    if shared:
        on = _in_one_buffer(on)
    got = y.to(device)
    triton_lora.lora_add(x.to(device), got, make_segments(RUNS, device), on,
                         triton_lora.LoRATiles(block_m=16, block_k=16, block_n=16))
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.skipif(cpu_lora._library() is None,
                    reason="no C compiler: the torch path runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_sends_each_segment_to_its_side_of_the_row_threshold(monkeypatch, dtype):
    """Below the host's threshold a segment goes to the native kernel, from it on to
    torch; a step with both (decodes beside a long prefill) splits, and every mix agrees
    with the reference. Without a threshold (bf16 where torch has no bf16 unit, float32 on
    AVX-512 builds) long segments stay native."""
    threshold = dispatch.lora_torch_min_rows(dtype)
    table = dispatch.LORA_TORCH_MIN_ROWS
    assert threshold == table.get(cpu_features.detect().isa, table["baseline"])[dtype]
    short, long = (threshold - 1, threshold) if threshold else (15, 600)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(short + long, 40, generator=gen).to(dtype)
    y = torch.randn(short + long, 24, generator=gen).to(dtype)
    weights = [LoRAWeights.of((torch.randn(r, 40, generator=gen) * 0.3).to(dtype),
                           (torch.randn(24, r, generator=gen) * 0.3).to(dtype)) for r in (8, 4)]
    native_calls = []
    real = cpu_lora.lora_add

    def spy(x, y, segments, weights):
        native_calls.append([w is not None for w in weights])
        return real(x, y, segments, weights)

    monkeypatch.setattr(cpu_lora, "lora_add", spy)
    cases = {"short only": ([[(0, short)]], [[True]]),
             "long only": ([[(short, short + long)]], [] if threshold else [[True]]),
             "both": ([[(0, short)], [(short, short + long)]],
                      [[True, False]] if threshold else [[True, True]])}
    for name, (runs, expected_calls) in cases.items():
        native_calls.clear()
        segments = make_segments(runs)
        got = y.clone()
        dispatch.lora_add(x, got, segments, weights[:len(runs)])
        assert native_calls == expected_calls, name
        torch.testing.assert_close(got, _reference(x, y, segments, weights[:len(runs)]),
                                   **TOLERANCE[dtype], msg=name)
