"""The native float32 batch GEMM (kernels/cpu/gemm_f32.c) against float64 math, its rows
independent of the batch around them, and where dispatch picks it."""

import pytest
import torch

from kernels.cpu import features as cpu_features
from kernels.cpu import gemm as cpu_gemm
from testing.gguf_weights import gguf_weight
from testing.native_build import CAN_DISASSEMBLE, disassemble
from testing.threads import torch_threads

pytestmark = pytest.mark.skipif(cpu_gemm._library() is None,
                                reason="no C compiler: the engine keeps oneDNN / torch")


def _operands(rows, out_features, in_features, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, in_features, generator=g),
            torch.randn(out_features, in_features, generator=g),
            torch.randn(out_features, generator=g))


@pytest.mark.parametrize("rows, out_features, in_features",
                         [(1, 1, 1), (1, 70, 33), (1, 200, 96), (2, 200, 96), (2, 17, 577),
                          (3, 15, 5), (6, 16, 64), (7, 17, 64), (13, 40, 577), (64, 200, 96)])
def test_gemm_matches_float64_math(rows, out_features, in_features):
    x, weight, bias = _operands(rows, out_features, in_features)
    panels = cpu_gemm.pack(weight)
    assert panels.shape == (-(-out_features // 16), in_features, 16)
    expected = x.double() @ weight.double().T + bias.double()
    for b, ref in ((bias, expected), (None, expected - bias.double())):
        out = cpu_gemm.gemm(x, panels, out_features, b)
        assert out.shape == (rows, out_features) and out.dtype == torch.float32
        # float32 sums over k terms of unit-variance products
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6 * in_features + 1e-5)


def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads():
    """Same row, same bits: alone (one row takes 6-panel groups instead of the 6-row
    tile; n = 88 leaves a short group and a short panel), at every position of a tile,
    across the x chunks (k = 2048: 64-row chunks) and on 1 or 2 threads."""
    x, weight, bias = _operands(131, 88, 2048, seed=1)
    panels = cpu_gemm.pack(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = cpu_gemm.gemm(x, panels, 88, bias)
        torch.set_num_threads(1)
        single = torch.cat([cpu_gemm.gemm(x[i:i + 1], panels, 88, bias) for i in range(131)])
        shifted = cpu_gemm.gemm(x[5:], panels, 88, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, single)
    assert torch.equal(batch[5:], shifted)


def test_one_and_two_row_calls_give_the_batch_tiles_bits():
    """The decode step's rows (the 1- and 2-row tiles, 6 or 3 panels at a time, a short last
    group) against the same rows inside a 6-row tile, on 1 and 2 threads."""
    x, weight, bias = _operands(12, 200, 96, seed=5)
    panels = cpu_gemm.pack(weight)
    batch = cpu_gemm.gemm(x, panels, 200, bias)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for i in range(0, 12, 2):
                assert torch.equal(cpu_gemm.gemm(x[i:i + 2], panels, 200, bias), batch[i:i + 2])
                assert torch.equal(cpu_gemm.gemm(x[i + 1:i + 2], panels, 200, bias),
                                   batch[i + 1:i + 2])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu_gemm.unpack(panels, 200), weight)


def test_other_dtypes_and_shapes_are_declined():
    x, weight, bias = _operands(4, 16, 32)
    assert cpu_gemm.pack(weight.bfloat16()) is None
    panels = cpu_gemm.pack(weight)
    assert cpu_gemm.gemm(x.bfloat16(), panels, 16, None) is None
    assert cpu_gemm.gemm(x[:, :31], panels, 16, None) is None
    assert cpu_gemm.gemm(x, panels, 16, bias.double()) is None
    assert cpu_gemm.gemm(x[None], panels, 16, None) is None


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 5, 32), (17, 13, 96),
                                                             (40, 64, 576)])
def test_gguf_gemm_matches_float64_math_on_the_dequantized_weights(type_name, rows,
                                                                   out_features, in_features):
    weight, dense = gguf_weight(type_name, out_features, in_features)
    x, _, bias = _operands(rows, out_features, in_features, seed=2)
    out = cpu_gemm.gemm_gguf(x, weight, bias)
    expected = x.double() @ dense.double().T + bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * in_features + 1e-5)
    # a row's result is the same alone (the x panels pad it with zero rows)
    assert torch.equal(cpu_gemm.gemm_gguf(x[-1:], weight, bias), out[-1:])
    assert cpu_gemm.gemm_gguf(x.bfloat16(), weight, bias) is None
    assert cpu_gemm.gemm_gguf(x[:, 1:], weight, bias) is None


def test_gguf_gemm_rows_across_x_chunks_match_and_keep_their_bits():
    """k = 2048 puts 3 x panels (48 rows) in a chunk, so 131 rows cross three chunk edges:
    every chunk sees every weight row, and a row's bits do not depend on its chunk or the
    thread count."""
    weight, dense = gguf_weight("Q4_1", 13, 2048, seed=3)
    x, _, bias = _operands(131, 13, 2048, seed=4)
    out = cpu_gemm.gemm_gguf(x, weight, bias)
    expected = x.double() @ dense.double().T + bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * 2048 + 1e-5)
    with torch_threads(1):
        one_thread = cpu_gemm.gemm_gguf(x, weight, bias)
    assert torch.equal(one_thread, out)
    for row in (0, 47, 48, 130):
        assert torch.equal(cpu_gemm.gemm_gguf(x[row:row + 1], weight, bias), out[row:row + 1])
    assert torch.equal(cpu_gemm.gemm_gguf(x[40:], weight, bias), out[40:])


def test_the_gemm_is_preferred_exactly_on_avx2_builds_without_avx512():
    """Measured faster than oneDNN on AVX2 (Zen 2); AVX-512 builds keep oneDNN's 16-wide
    kernels (and the capped pass on such hosts runs this kernel at avx2)."""
    flags = cpu_features.detect().flags
    assert cpu_gemm.preferred() == ({"avx2", "fma"} <= flags and "avx512f" not in flags)


@pytest.mark.skipif(not CAN_DISASSEMBLE, reason="needs gcc and objdump")
@pytest.mark.parametrize("march, fma", [(["-march=x86-64"], False), (["-march=x86-64-v3"], True),
                                        (["-march=x86-64-v4"], True)])
def test_every_isa_builds_the_gemm(tmp_path, march, fma):
    disassembly = disassemble("gemm_f32.c", march, tmp_path)
    assert ("vfmadd231ps" in disassembly or "vfmadd213ps" in disassembly) == fma
