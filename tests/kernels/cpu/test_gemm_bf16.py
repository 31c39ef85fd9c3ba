"""The AVX-512 BF16 GEMM (kernels/cpu/gemm_bf16.c), its AMX tile twin on the same panels,
and the panels: the packing round-trips bit-exactly on every host; where the build has a
kernel, its numbers against float32 sums of the same bf16 values and a row's bits whatever
its batch or the threads; the build carries vdpbf16ps exactly where the compiler targets
AVX-512 BF16, and tile instructions exactly where it targets AMX."""
from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.cpu import features as cpu_features
from kernels.cpu import gemm as cpu_gemm
from testing.native_build import CAN_DISASSEMBLE, disassemble
from testing.threads import torch_threads

needs_native = pytest.mark.skipif(cpu_gemm.bf16_built() is None, reason="no native library")
needs_bf16 = pytest.mark.skipif(
    not cpu_gemm.bf16_built(),
    reason="needs the native library built for AVX-512 BF16 (an uncapped CPU with "
           "avx512_bf16, avx512bw and avx512vl)")

needs_tiles = pytest.mark.skipif(
    not cpu_gemm.bf16_amx_built(),
    reason="needs the native library built for AMX (an uncapped CPU with amx_tile and "
           "amx_bf16)")


def _operands(rows: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    return x, weight, bias


@needs_native
@pytest.mark.parametrize("n", [1, 16, 33, 70])  # one lane, one panel, a padded pair, 3 pairs
@pytest.mark.parametrize("k", [2, 64, 577])  # one pair, several, and an odd width (padded)
def test_panels_round_trip_bit_exactly(n, k):
    _, weight, _ = _operands(1, n, k, seed=n + k)
    panels = cpu_gemm.pack_bf16(weight)
    assert panels.dtype == torch.bfloat16
    assert panels.shape == (-(-n // 32) * 2, -(-k // 2), 16, 2)
    assert torch.equal(cpu_gemm.unpack_bf16(panels, n, k), weight)
    # Padding is zeros: outputs past n and the odd k's last pair member.
    assert int((panels != 0).sum()) == int((weight != 0).sum())


def _check_float32_sums(rows, n, k, tiles):
    x, weight, bias = _operands(rows, n, k, seed=rows + n + k)
    panels = cpu_gemm.pack_bf16(weight)
    exact = x.double() @ weight.double().T
    for b in (None, bias):
        got = cpu_gemm.gemm_bf16(x, panels, n, b, tiles=tiles)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        expected = exact + (0 if b is None else b.double())
        # float32 sums, one rounding to bf16 at the end: within one bf16 ulp (2^-7 relative)
        # plus the sums' own float32 error.
        err = (got.double() - expected).abs()
        bound = expected.abs() * 2 ** -8 + 1e-5 * (x.double().abs() @ weight.double().abs().T)
        assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 33, 300])  # every register count,
@pytest.mark.parametrize("n", [5, 32, 70])  # several groups and chunks; lanes unused, a whole pair
@pytest.mark.parametrize("k", [2, 96, 576])
def test_matches_float32_sums_of_the_same_values(rows, n, k):
    _check_float32_sums(rows, n, k, tiles=False)


@needs_tiles
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 48, 300])  # a padded tile, whole ones,
@pytest.mark.parametrize("n", [5, 32, 70])  # one tile of two, a pair, and an odd one; chunks
@pytest.mark.parametrize("k", [32, 576, 2048, 8192])  # 8192 at 300 rows: k in blocks
def test_tiles_match_float32_sums_of_the_same_values(rows, n, k):
    _check_float32_sums(rows, n, k, tiles=True)


@needs_tiles
def test_tiles_bits_do_not_depend_on_the_batch_or_the_threads_and_odd_widths_decline():
    """Each output is one chain of tile dot products over k in order: the rows beside it, a
    padded last tile, k split in blocks (300 rows of 8192: six blocks, the partial sums
    kept in float32 between them; a single row: none) and the thread count do not change
    it."""
    x, weight, bias = _operands(300, 70, 8192, seed=5)
    panels = cpu_gemm.pack_bf16(weight)
    full = cpu_gemm.gemm_bf16(x, panels, 70, bias, tiles=True)
    for m in (1, 15, 16, 17, 33):
        assert torch.equal(cpu_gemm.gemm_bf16(x[:m], panels, 70, bias, tiles=True), full[:m])
    assert torch.equal(cpu_gemm.gemm_bf16(x[150:151], panels, 70, bias, tiles=True),
                       full[150:151])
    with torch_threads(1):
        assert torch.equal(cpu_gemm.gemm_bf16(x, panels, 70, bias, tiles=True), full)
    # k must be whole tile steps of 32; the vdpbf16ps kernel takes the rest.
    narrow = cpu_gemm.pack_bf16(weight[:, :96].contiguous())
    x96 = x[:, :96].contiguous()
    assert cpu_gemm.gemm_bf16(x96, narrow, 70, bias, tiles=True) is not None
    odd = cpu_gemm.pack_bf16(weight[:, :80].contiguous())
    assert cpu_gemm.gemm_bf16(x[:, :80].contiguous(), odd, 70, bias, tiles=True) is None


@needs_bf16
@pytest.mark.parametrize("k", [96, 2048])  # 300 rows in one L2 chunk of x, and in three
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(k):
    """Each output is one vdpbf16ps chain over k in order, whichever rows share its tile:
    a decode row, the same row in a prefill chunk and in a batch-invariant run agree."""
    x, weight, bias = _operands(300, 70, k, seed=4)
    panels = cpu_gemm.pack_bf16(weight)
    full = cpu_gemm.gemm_bf16(x, panels, 70, bias)
    exact = x.double() @ weight.double().T + bias.double()
    assert float((full.double() - exact).abs().max()) < 0.01 * float(exact.abs().max())
    for m in (1, 2, 3, 8, 9, 17):
        assert torch.equal(cpu_gemm.gemm_bf16(x[:m], panels, 70, bias), full[:m])
    assert torch.equal(cpu_gemm.gemm_bf16(x[150:151], panels, 70, bias), full[150:151])
    with torch_threads(1):
        assert torch.equal(cpu_gemm.gemm_bf16(x, panels, 70, bias), full)


@needs_bf16
def test_zero_rows_give_the_bias_and_rounding_is_torchs():
    x, weight, bias = _operands(4, 40, 64, seed=2)
    x[1] = 0
    panels = cpu_gemm.pack_bf16(weight)
    got = cpu_gemm.gemm_bf16(x, panels, 40, bias)
    assert torch.equal(got[1], bias)
    # One row, one weight column of ones: the sum is exact in float32 and the rounding is
    # torch's nearest-even of it.
    ones = torch.ones(16, 64, dtype=torch.bfloat16)
    row = torch.randn(1, 64).bfloat16()
    summed = cpu_gemm.gemm_bf16(row, cpu_gemm.pack_bf16(ones), 16, None)
    assert torch.equal(summed, row.float().sum(1, keepdim=True).expand(1, 16).bfloat16())


@needs_native
def test_declines_what_it_does_not_take():
    x, weight, bias = _operands(3, 40, 64)
    panels = cpu_gemm.pack_bf16(weight)
    assert cpu_gemm.gemm_bf16(x.float(), panels, 40, None) is None
    assert cpu_gemm.gemm_bf16(x, panels, 40, bias.float()) is None
    assert cpu_gemm.gemm_bf16(x[:, :62], panels, 40, None) is None
    odd = cpu_gemm.pack_bf16(weight[:, :63].contiguous())
    assert cpu_gemm.gemm_bf16(x[:, :63], odd, 40, None) is None  # x is read in pairs
    assert cpu_gemm.pack_bf16(weight.float()) is None


@needs_native
def test_prepare_serves_bf16_panels_exactly_where_they_are_preferred():
    """On AVX-512 BF16 and AMX the panels replace the dense copy and oneDNN's and take
    every row count, one row included (on the tiles from BF16_TILES_MIN_ROWS where the
    build has them); elsewhere nothing changes."""
    x, weight, bias = _operands(40, 40, 64, seed=7)
    prepared = dispatch.prepare_linear(weight, bias)
    preferred = dispatch.bf16_panels_preferred()
    assert preferred == (bool(cpu_gemm.bf16_built())
                         and cpu_features.detect().isa in ("avx512_bf16", "amx"))
    assert prepared.kind == ("panels" if preferred else
                             "onednn" if cpu_features.detect().can_prepack_bf16 else "dense")
    if not preferred:
        return
    assert prepared.dense is None and prepared.packed is None
    assert prepared.in_features == 64 and prepared.out_features == 40
    assert torch.equal(dispatch.unpack_linear(prepared), weight)
    tiles = bool(cpu_gemm.bf16_amx_built())
    assert tiles == (cpu_features.detect().isa == "amx")
    for rows in (1, dispatch.BF16_TILES_MIN_ROWS - 1, dispatch.BF16_TILES_MIN_ROWS, 40):
        on_tiles = tiles and rows >= dispatch.BF16_TILES_MIN_ROWS
        assert torch.equal(dispatch.linear(x[:rows], prepared),
                           cpu_gemm.gemm_bf16(x[:rows], prepared.panels, 40, bias,
                                              tiles=on_tiles))
    # Odd widths and batch-invariant weights keep their paths.
    assert dispatch.prepare_linear(weight[:, :63].contiguous(), bias).kind != "panels"
    assert dispatch.prepare_linear(weight, bias, batch_invariant=True).kind == "invariant"


def test_the_build_carries_the_kernel_exactly_where_the_cpu_has_avx512_bf16():
    """Uncapped builds use -march=native; a cap (TLE_CPU_ISA) builds for its level's
    -march: at avx512_bf16 and amx that has AVX-512 BF16, below it not, and oneDNN serves."""
    if cpu_gemm.bf16_built() is None:
        pytest.skip("no native library")
    features = cpu_features.detect()
    if features.capped:
        has = features.isa in ("avx512_bf16", "amx")
    else:
        has = {"avx512_bf16", "avx512bw", "avx512vl"} <= features.flags
    assert cpu_gemm.bf16_built() == has


def test_the_build_carries_the_tiles_exactly_where_the_cpu_has_amx():
    if cpu_gemm.bf16_amx_built() is None:
        pytest.skip("no native library")
    features = cpu_features.detect()
    assert cpu_gemm.bf16_amx_built() == (features.isa == "amx")


@pytest.mark.skipif(not CAN_DISASSEMBLE, reason="needs gcc and objdump")
@pytest.mark.parametrize("march, bf16, tiles", [(["-march=x86-64"], False, False),
                                                (["-march=x86-64-v3"], False, False),
                                                (["-march=x86-64-v4"], False, False),
                                                (["-march=x86-64-v4", "-mavx512bf16"], True, False),
                                                (["-march=cooperlake"], True, False),
                                                (["-march=sapphirerapids"], True, True)])
def test_every_isa_builds_the_file(tmp_path, march, bf16, tiles):
    disassembly = disassemble("gemm_bf16.c", march, tmp_path)
    assert ("vdpbf16ps" in disassembly) == bf16
    assert ("tdpbf16ps" in disassembly) == tiles


@needs_tiles
@pytest.mark.parametrize("rows,k,inter", [
    (2, 64, 32),         # the least: one row tile, one panel pair a half
    (37, 576, 1536),     # SmolLM2's MLP, a ragged last row tile
    (300, 2048, 8192),   # Llama-3.2-1B's, k split into blocks past 128 rows
    (1100, 576, 1536),   # several row chunks
])
def test_gate_up_ends_in_silu_mul_with_the_same_bits(rows, k, inter):
    # One pass on the tiles against the tiles' gate_up product, then silu_mul_bf16: the
    # same bits, with and without a bias, at 1 and 2 threads.
    x, weight, bias = _operands(rows, 2 * inter, k, seed=rows + k)
    panels = cpu_gemm.pack_bf16(weight)
    for b in (None, bias):
        want = dispatch.silu_mul(cpu_gemm.gemm_bf16(x, panels, 2 * inter, b, tiles=True))
        for threads in (1, 2):
            with torch_threads(threads):
                got = cpu_gemm.gemm_bf16_silu(x, panels, inter, b)
            assert torch.equal(got, want), (threads, b is not None)


@needs_tiles
def test_gate_up_silu_declines_an_inter_off_the_panel_pairs():
    x, weight, _ = _operands(4, 2 * 48, 64)
    assert cpu_gemm.gemm_bf16_silu(x, cpu_gemm.pack_bf16(weight), 48, None) is None


def test_dispatch_fuses_silu_mul_into_gate_up_exactly_on_amx_builds(monkeypatch):
    x, weight, bias = _operands(8, 2 * 64, 64, seed=3)
    prepared = dispatch.prepare_linear(weight, bias)
    fused = []
    kernel = cpu_gemm.gemm_bf16_silu
    monkeypatch.setattr(cpu_gemm, "gemm_bf16_silu",
                        lambda *args: fused.append(args[0].shape[0]) or kernel(*args))
    got = dispatch.gate_up_silu(x, prepared)
    torch.testing.assert_close(got.float(),
                               dispatch.silu_mul(x @ weight.T + bias).float(), atol=0.1, rtol=0.05)
    assert fused == ([8] if prepared.panels is not None and cpu_gemm.bf16_amx_built() else [])
    # One row stays on the row kernels (the fused single-sequence step's bits), and
    # batch-invariant weights never take the tiles.
    fused.clear()
    dispatch.gate_up_silu(x[:1], prepared)
    dispatch.gate_up_silu(x, dispatch.prepare_linear(weight, bias, batch_invariant=True))
    assert fused == []
