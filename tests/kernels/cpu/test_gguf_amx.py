"""The AMX GGUF kernel (kernels/cpu/linear_gguf_amx.c): its numbers against a float64
product of the same bf16-rounded operands, on hosts with AMX; its build on every ISA level
(tile instructions exactly where the compiler targets AMX)."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import features as cpu_features
from kernels.cpu import linear as cpu_linear
from kernels.gguf_weight import BLOCK
from testing.gguf_weights import gguf_weight
from testing.native_build import CAN_DISASSEMBLE, disassemble
from testing.threads import torch_threads

_HOST_AMX = cpu_features.detect().isa == "amx"
needs_amx = pytest.mark.skipif(
    not (_HOST_AMX and cpu_linear.available() and cpu_linear.gguf_amx_available()),
    reason="needs a CPU at the amx level (TLE_CPU_ISA not capping it), the native library "
           "built with AMX, and Linux granting the tile state")


def _widened(weight) -> torch.Tensor:
    """W as the kernel widens it: d * u + offset (d * q for Q8_0) rounded once to float32
    (one FMA), then to bf16."""
    n, d = weight.out_features, weight.d.double().unsqueeze(-1)
    if weight.offset is None:
        codes = weight.qs.reshape(n, -1, BLOCK).double()
        values = d * codes
    else:
        packed = weight.qs.reshape(n, -1, BLOCK // 2).to(torch.int16)
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).double()
        values = d * codes + weight.offset.double().unsqueeze(-1)
    return values.reshape(n, -1).float().bfloat16()


def _check(type_name: str, m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool = True):
    weight, _ = gguf_weight(type_name, n, k, seed=m + n + k)
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g) if with_bias else None
    out = cpu_linear.linear_gguf_amx(x, weight, bias)
    assert out is not None and out.dtype == dtype and out.shape == (m, n)
    xb, wb = x.bfloat16().double(), _widened(weight).double()
    expected = xb @ wb.T + (0 if bias is None else bias.double())
    # The products of bf16 operands are exact in float32; what remains is the float32
    # sums' rounding (bounded by k ulps of the magnitude sum) and, for a bf16 output, its
    # own rounding (half a bf16 ulp: 2^-9 relative).
    magnitude = xb.abs() @ wb.abs().T + (0 if bias is None else bias.double().abs())
    bound = 2 * k * 2.0 ** -24 * magnitude + 1e-30
    if dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * expected.abs()
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())


@needs_amx
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 64])
@pytest.mark.parametrize("n, k", [(40, 32), (40, 576), (576, 576), (40, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amx_kernel_matches_the_bf16_rounded_product(type_name, m, n, k, dtype):
    _check(type_name, m, n, k, dtype)


@needs_amx
@pytest.mark.parametrize("n", [1, 16, 31, 33])
def test_amx_kernel_without_bias_and_odd_output_counts(n):
    _check("Q4_1", 19, n, 96, torch.bfloat16, with_bias=False)


@needs_amx
def test_amx_kernel_gives_the_same_bits_for_any_thread_count():
    weight, _ = gguf_weight("Q8_0", 200, 576, seed=5)
    x = torch.randn(37, 576).bfloat16()
    with torch_threads(1):
        one = cpu_linear.linear_gguf_amx(x, weight, None)
    assert torch.equal(one, cpu_linear.linear_gguf_amx(x, weight, None))


@needs_amx
def test_amx_kernel_declines_what_it_does_not_take():
    weight, _ = gguf_weight("Q4_0", 40, 64)
    assert cpu_linear.linear_gguf_amx(torch.randn(64).bfloat16(), weight, None) is None
    assert cpu_linear.linear_gguf_amx(torch.randn(4, 64).half(), weight, None) is None
    assert cpu_linear.linear_gguf_amx(torch.randn(4, 64).bfloat16(), weight,
                                      torch.randn(40).bfloat16()) is None


def test_the_build_carries_the_tile_kernel_exactly_on_amx():
    """The kernel is compiled where the flags target AMX (uncapped -march=native on an
    AMX CPU), and chosen only there; a capped process (TLE_CPU_ISA below amx) has neither."""
    if not cpu_linear.available():
        pytest.skip("no native library")
    features = cpu_features.detect()
    uncapped_amx = features.isa == "amx" and not features.capped
    assert cpu_linear.gguf_amx_built() == uncapped_amx
    if not uncapped_amx:
        assert not cpu_linear.gguf_amx_available()


@pytest.mark.skipif(not CAN_DISASSEMBLE, reason="needs gcc and objdump")
@pytest.mark.parametrize("march, tiles", [(["-march=x86-64"], False),
                                          (["-march=x86-64-v3"], False),
                                          (["-march=x86-64-v4"], False),
                                          (["-march=x86-64-v4", "-mavx512bf16"], False),
                                          (["-march=sapphirerapids"], True)])
def test_every_isa_builds_the_amx_file(tmp_path, march, tiles):
    disassembly = disassemble("linear_gguf_amx.c", march, tmp_path)
    assert ("tdpbf16ps" in disassembly) == tiles
    assert ("tileloadd" in disassembly or "ldtilecfg" in disassembly) == tiles
