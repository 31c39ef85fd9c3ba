"""The native matmuls (kernels/cpu/linear_f32.c, linear_bf16.c, linear_quant.c) against
torch, and the GGUF block layout against the gguf package's own quantize/dequantize."""
import shutil

import pytest
import torch

from kernels import dispatch
from kernels.cpu import features as cpu_features
from kernels.cpu import linear as cpu_linear
from kernels import torch_ops
from kernels.gguf_weight import FORMATS, GgufWeight
from testing.gguf_weights import gguf_weight
from testing.native_build import CAN_DISASSEMBLE, disassemble

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine falls back to torch")


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_layout_dequantizes_to_the_gguf_package_values(type_name):
    weight, expected = gguf_weight(type_name, 37, 96)
    torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=1e-6)
    rows = torch.tensor([36, 0, 5, 5])
    torch.testing.assert_close(weight.dequantize(rows), expected[rows], rtol=0, atol=1e-6)
    torch.testing.assert_close(cpu_linear.dequantize_rows(weight, rows), expected[rows],
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
@pytest.mark.parametrize("in_features", [32, 96, 576, 1536])  # 1, 3 (odd), 18, 48 blocks
@pytest.mark.parametrize("rows", [1, 2, 5, 33])
def test_quantized_linear_matches_its_torch_definition(type_name, in_features, rows):
    weight, dense = gguf_weight(type_name, 67, in_features, seed=in_features + rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(67)
    got = cpu_linear.linear_gguf(x, weight, bias)  # the int8 kernel at every row count
    expected = torch_ops.gguf_linear(x, weight, bias)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5 * scale)
    # and the int8 activations cost little against the exact product
    exact = x @ dense.T + bias
    assert float((got - exact).abs().max()) < 0.02 * float(exact.abs().max())


def test_quantized_linear_in_bf16_and_zero_rows():
    weight, _ = gguf_weight("Q4_1", 40, 64)
    x = torch.randn(3, 64)
    x[1] = 0.0  # an all-zero block has scale 0: codes 0, no division by zero
    got = dispatch.gguf_linear(x.bfloat16(), weight, None)
    assert got.dtype == torch.bfloat16
    expected = torch_ops.gguf_linear(x.bfloat16().float(), weight, None)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[1].float(), (weight.offset.sum(1) * 0).float())


def test_quantized_weights_concatenate_row_wise():
    a, dense_a = gguf_weight("Q4_0", 10, 64, seed=1)
    b, dense_b = gguf_weight("Q4_0", 6, 64, seed=2)
    fused = GgufWeight.concat([a, b])
    torch.testing.assert_close(fused.dequantize(), torch.cat([dense_a, dense_b]), rtol=0, atol=1e-6)
    c, _ = gguf_weight("Q8_0", 6, 64)
    with pytest.raises(ValueError, match="differ in format"):
        GgufWeight.concat([a, c])


def test_unsupported_formats_and_widths_are_refused():
    with pytest.raises(ValueError, match="Q6_K is not supported"):
        GgufWeight.from_blocks("Q6_K", torch.zeros(2, 210, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="need 36 bytes"):
        GgufWeight.from_blocks("Q4_0", torch.zeros(2, 30, dtype=torch.uint8), 64)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("in_features", [8, 577, 1536])
@pytest.mark.parametrize("out_features", [1, 3, 4, 130])
def test_dense_row_kernel_matches_torch(rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows * in_features + out_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    got = dispatch.dense_linear_rows(x, weight, bias)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)
    assert dispatch.dense_linear_rows(x, weight, None) is not None
    # other dtypes and larger batches are left to oneDNN / torch
    assert dispatch.dense_linear_rows(x.half(), weight.half(), None) is None
    assert dispatch.dense_linear_rows(torch.randn(dispatch.DENSE_ROWS_MAX + 1, in_features),
                                      weight, None) is None


def test_long_chunks_take_the_dense_gemm_on_the_dequantized_table():
    weight, dense = gguf_weight("Q4_1", 40, 96)
    x = torch.randn(dispatch.GGUF_DENSE_MIN_ROWS, 96)
    bias = torch.randn(40)
    # exact in x (no int8 activations) from GGUF_DENSE_MIN_ROWS rows on
    torch.testing.assert_close(dispatch.gguf_linear(x, weight, bias), x @ dense.T + bias,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_linear.dequantize_rows(weight, None), dense, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("in_features", [8, 31, 577, 2048])
@pytest.mark.parametrize("out_features", [1, 3, 4, 130])
def test_bf16_row_kernel_matches_float32_math_on_bf16_values(rows, in_features, out_features):
    """float32 sums of exact bf16 products, one rounding at the end: within one bf16 ulp
    of the float32 result (the sums' order differs), whichever inner loop this build has."""
    g = torch.Generator().manual_seed(7 * rows + in_features + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    got = cpu_linear.linear_bf16_rows(x, weight, bias)
    assert got is not None and got.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -7, atol=1e-3 * in_features ** 0.5)
    no_bias = cpu_linear.linear_bf16_rows(x, weight, None)
    torch.testing.assert_close(no_bias.double(), x.double() @ weight.double().T,
                               rtol=2 ** -7, atol=1e-3 * in_features ** 0.5)
    # float32 inputs and a float32 bias are refused, not misread
    assert cpu_linear.linear_bf16_rows(x.float(), weight, None) is None
    assert cpu_linear.linear_bf16_rows(x, weight, bias.float()) is None


def test_bf16_row_kernel_runs_vdpbf16ps_exactly_where_the_cpu_has_it():
    """The build follows the CPU (or TLE_CPU_ISA's cap): AVX-512 BF16 hosts run the
    vdpbf16ps loop, every other the widen-and-FMA one; the correctness test above then
    covers whichever this host built (the capped pass covers the other on BF16 hosts)."""
    if cpu_linear.bf16_rows_use_dpbf16() is None:
        pytest.skip("no native library")
    assert cpu_linear.bf16_rows_use_dpbf16() == ("avx512_bf16" in cpu_features.detect().flags)


@pytest.mark.skipif(not CAN_DISASSEMBLE, reason="needs gcc and objdump")
@pytest.mark.parametrize("march, dpbf16", [(["-march=x86-64"], False),
                                           (["-march=x86-64-v3"], False),
                                           (["-march=x86-64-v4", "-mavx512bf16"], True)])
def test_every_bf16_row_loop_builds_on_any_host(tmp_path, march, dpbf16):
    """Each ISA's loop compiles here even where this CPU cannot run it, and the AVX-512
    BF16 build really holds vdpbf16ps."""
    disassembly = disassemble("linear_bf16.c", march, tmp_path)
    assert ("vdpbf16ps" in disassembly) == dpbf16


def _quantizer_levels() -> list[list[str]]:
    """-march flags for every level of the x86 quantizer this CPU can run: the scalar
    loop, AVX2 and AVX-512 BW intrinsics."""
    features = cpu_features.detect()
    if not features.is_x86:
        return []
    levels = [["-march=x86-64"]]
    if {"avx2", "fma"} <= features.flags:
        levels.append(["-march=x86-64-v3"])
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= features.flags:
        levels.append(["-march=x86-64-v4"])
    return levels


@pytest.mark.parametrize("is_bf16", [0, 1])
def test_the_activation_quantizer_gives_the_scalar_bits_at_every_isa_level(tmp_path, is_bf16):
    """gguf_quantize_x's AVX2 and AVX-512 loops against its scalar one, each built from the
    same source for its -march: the same codes, scales and code sums to the bit (ties,
    zeros, the pair layout's odd last block included). scale * sum is the same scalar
    line in every build, but -ffast-math may order its product differently per -march."""
    import ctypes

    from kernels.cpu import native as cpu_native

    compiler = shutil.which("cc") or shutil.which("gcc")
    sources = [cpu_native.SOURCES[0].with_name(n)
               for n in ("gguf_quantize.c", "linear_quant.c", "linear_gguf_vnni.c")]
    rows, k = 5, 7 * 32
    g = torch.Generator().manual_seed(is_bf16)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, k)
    x[1] = 0.0
    x[2, :32] = torch.arange(32) * 0.5 - 7.75  # exact halves after scaling: ties to even
    x = x.bfloat16() if is_bf16 else x
    results = []
    for march in _quantizer_levels():
        lib_path = str(tmp_path / f"q{len(results)}.so")
        error = cpu_native.build_shared(compiler, [*cpu_native.COMPILE_FLAGS, *march], sources,
                                        str(tmp_path), lib_path)
        assert error is None, error
        fn = ctypes.CDLL(lib_path).gguf_quantize_x
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int]
        out = []
        for pair_layout in (0, 1):
            q = torch.zeros(rows, k, dtype=torch.int8)
            scale, qsum = torch.zeros(rows, k // 32), torch.zeros(rows, k // 32)
            isum = torch.zeros(rows, k // 32, dtype=torch.int32)
            fn(x.data_ptr(), is_bf16, rows, k, pair_layout, q.data_ptr(), scale.data_ptr(),
               qsum.data_ptr(), isum.data_ptr(), 1)
            out.append((q, scale, qsum, isum))
        results.append(out)
    assert results and results[0][0][0].abs().max() == 127
    for other in results[1:]:
        for (q, scale, qsum, isum), (q2, scale2, qsum2, isum2) in zip(results[0], other):
            assert torch.equal(q, q2) and torch.equal(scale, scale2) and torch.equal(isum, isum2)
            torch.testing.assert_close(qsum, qsum2, rtol=2e-7, atol=0)
