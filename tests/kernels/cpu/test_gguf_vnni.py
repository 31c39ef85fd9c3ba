"""The AVX-512 VNNI GGUF kernel (kernels/cpu/linear_gguf_vnni.c) and its panel layout
(GgufWeight.to_panels): the layout round-trips bit-exactly and its lookup equals the rows'
on every host; the kernel's numbers against the torch definition, and a row's result for
any batch, where the build has it; the build carries vpdpbusd exactly where the compiler
targets VNNI."""
from __future__ import annotations

import pytest
import torch

from kernels import dispatch, torch_ops
from kernels.cpu import features as cpu_features
from kernels.cpu import linear as cpu_linear
from kernels.gguf_weight import FORMATS
from testing.gguf_weights import gguf_weight
from testing.native_build import CAN_DISASSEMBLE, disassemble
from testing.threads import torch_threads

needs_native = pytest.mark.skipif(not cpu_linear.available(), reason="no native library")
needs_vnni = pytest.mark.skipif(
    not (cpu_linear.available() and cpu_linear.gguf_vnni_built()),
    reason="needs the native library built for AVX-512 VNNI (an uncapped CPU with "
           "avx512_vnni and avx512bw)")


@pytest.mark.parametrize("type_name", sorted(FORMATS))
@pytest.mark.parametrize("n", [1, 16, 37])
def test_panels_round_trip_and_dequantize_as_the_rows_do(type_name, n):
    rows, expected = gguf_weight(type_name, n, 96, seed=n)
    panels = rows.to_panels()
    assert panels.layout == "panels" and panels.out_features == n
    assert panels.qs.shape[0] == -(-n // 16) and panels.to_panels() is panels
    back = panels.to_rows()
    assert back.layout == "rows" and back.qs.dtype == rows.qs.dtype
    assert torch.equal(back.qs, rows.qs) and torch.equal(back.d, rows.d)
    assert (back.offset is None) == (rows.offset is None)
    if rows.offset is not None:
        assert torch.equal(back.offset, rows.offset)
    assert torch.equal(panels.dequantize(), rows.dequantize())
    torch.testing.assert_close(panels.dequantize(), expected, rtol=0, atol=1e-6)


@needs_native
@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_the_embedding_lookup_reads_panels_bit_exactly(type_name):
    """A tied table is served as panels only: the lookup must read them (any build links
    the panel lookup, whether or not it has the VNNI kernel)."""
    rows, _ = gguf_weight(type_name, 37, 96, seed=2)
    ids = torch.tensor([36, 0, 5, 5, 17, 16])
    assert torch.equal(cpu_linear.dequantize_rows(rows.to_panels(), ids),
                       cpu_linear.dequantize_rows(rows, ids))
    assert torch.equal(cpu_linear.dequantize_rows(rows.to_panels(), None), rows.dequantize())
    assert torch.equal(dispatch.gguf_embedding(ids, rows.to_panels(), torch.bfloat16),
                       dispatch.gguf_embedding(ids, rows, torch.bfloat16))


@needs_vnni
@pytest.mark.parametrize("type_name", sorted(FORMATS))
@pytest.mark.parametrize("in_features", [32, 96, 576])  # 1, 3 (odd), 18 blocks
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33])  # every register count, and several groups
@pytest.mark.parametrize("n", [5, 16, 67])  # a panel's lanes unused, one whole, a padded last
def test_vnni_kernel_matches_its_torch_definition(type_name, in_features, rows, n):
    weight, dense = gguf_weight(type_name, n, in_features, seed=in_features + rows + n)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, in_features, generator=g), torch.randn(n, generator=g)
    got = cpu_linear.linear_gguf(x, weight.to_panels(), bias)
    expected = torch_ops.gguf_linear(x, weight, bias)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5 * scale)
    exact = x @ dense.T + bias
    assert float((got - exact).abs().max()) < 0.02 * float(exact.abs().max())
    unbiased = cpu_linear.linear_gguf(x, weight.to_panels(), None)
    torch.testing.assert_close(unbiased + bias, got, rtol=0, atol=1e-6 * scale)


@needs_vnni
@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_vnni_kernel_in_bf16_with_zero_rows(type_name):
    weight, _ = gguf_weight(type_name, 40, 64)
    x = torch.randn(11, 64)
    x[3] = 0.0  # an all-zero block: scale 0, codes 0
    got = cpu_linear.linear_gguf(x.bfloat16(), weight.to_panels(), None)
    assert got.dtype == torch.bfloat16 and got.shape == (11, 40)
    expected = torch_ops.gguf_linear(x.bfloat16().float(), weight, None)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    assert torch.equal(got[3].float(), torch.zeros(40))  # Q4_1's offsets meet sum(x) = 0


@needs_vnni
@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(type_name):
    """Each x row runs the same instructions in its own registers, whichever rows share
    its pass: the batch-invariant mode and the fused decode step take this kernel as is."""
    weight, _ = gguf_weight(type_name, 70, 96, seed=4)
    panels = weight.to_panels()
    g = torch.Generator().manual_seed(3)
    x, bias = torch.randn(300, 96, generator=g), torch.randn(70, generator=g)
    full = cpu_linear.linear_gguf(x, panels, bias)
    for m in (1, 2, 8, 9, 17):
        assert torch.equal(cpu_linear.linear_gguf(x[:m], panels, bias), full[:m])
    assert torch.equal(cpu_linear.linear_gguf(x[150:151], panels, bias), full[150:151])
    with torch_threads(1):
        assert torch.equal(cpu_linear.linear_gguf(x, panels, bias), full)
    assert torch.equal(dispatch.gguf_linear(x[:5], panels, bias, batch_invariant=True), full[:5])


@needs_native
def test_prepare_serves_panels_exactly_where_the_vnni_kernel_runs():
    weight, _ = gguf_weight("Q8_0", 40, 64)
    served = dispatch.prepare_gguf(weight)
    vnni = bool(cpu_linear.gguf_vnni_built()) and not cpu_linear.gguf_amx_available()
    assert served.layout == ("panels" if vnni else "rows")
    assert (served is weight) == (not vnni)
    assert dispatch.prepare_gguf(served) is served


def test_the_build_carries_the_vnni_kernel_exactly_where_the_cpu_has_it():
    """Uncapped builds use -march=native: VNNI is compiled in where the CPU has it; a cap
    (TLE_CPU_ISA) builds for its level's -march, which has no VNNI, so the rows serve."""
    if not cpu_linear.available():
        pytest.skip("no native library")
    features = cpu_features.detect()
    has = {"avx512_vnni", "avx512bw", "avx512f"} <= features.flags and not features.capped
    assert cpu_linear.gguf_vnni_built() == has


@pytest.mark.skipif(not CAN_DISASSEMBLE, reason="needs gcc and objdump")
@pytest.mark.parametrize("march, vnni", [(["-march=x86-64"], False),
                                         (["-march=x86-64-v3"], False),
                                         (["-march=x86-64-v4"], False),
                                         (["-march=x86-64-v4", "-mavx512vnni"], True),
                                         (["-march=cascadelake"], True),
                                         (["-march=sapphirerapids"], True)])
def test_every_isa_builds_the_vnni_file(tmp_path, march, vnni):
    disassembly = disassemble("linear_gguf_vnni.c", march, tmp_path)
    assert ("vpdpbusd" in disassembly) == vnni
