"""The fused-MoE kernel on MXFP4 experts (kernels/cpu/moe_mxfp4.c) against its definition:
kernels/torch_moe.fused_moe on kernels/torch_mxfp4.Mxfp4Stack (one expert dequantized at a
time); against the dense kernel (moe.c) on the dequantized weights, bit for bit; a row
alone and in a batch; masked ids; what it declines; and the dispatch door's routing of
the MXFP4 form, native and torch.

Run it under TLE_CPU_ISA=avx2 and =baseline too: the build then decodes through the
portable table lookup into float32 rows instead of AVX-512's vpermps (and, with AVX-512
BF16, bf16 rows for vdpbf16ps), which these same tests then check.
"""
import shutil

import pytest
import torch

from kernels import dispatch, torch_mxfp4
from kernels.cpu import moe as cpu_moe
from kernels.dispatch import moe as dispatch_moe
from kernels.torch_moe import ACTIVATIONS, fused_moe
from kernels.torch_mxfp4 import Mxfp4Stack
from testing.mxfp4 import quantize
from testing.native_build import CAN_DISASSEMBLE, disassemble
from tests.kernels.cpu.test_moe import assert_rows_batch_invariant, check_matches

pytestmark = pytest.mark.skipif(
    (shutil.which("cc") is None and shutil.which("gcc") is None) or cpu_moe._library() is None,
    reason="no C compiler: the engine falls back to torch")


def mxfp4_stack(dense: torch.Tensor, dtype: torch.dtype) -> Mxfp4Stack:
    return Mxfp4Stack(*quantize(dense), dtype)


def make_case(tokens, experts, top_k, hidden, inter, dtype, bias=False, seed=0):
    """test_moe.make_case's weights, quantized to MXFP4 (so every stage stays O(1), and
    every FP4 code, -0 included, occurs), and each token's top_k distinct experts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = mxfp4_stack(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5, dtype)
    w2 = mxfp4_stack(torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5, dtype)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), top_k)
    biases = {}
    if bias:
        biases = {"w13_bias": torch.randn(experts, 2 * inter, generator=g).to(dtype),
                  "w2_bias": torch.randn(experts, hidden, generator=g).to(dtype)}
    return x, w13, w2, weights, ids, biases


def dense(stack: Mxfp4Stack) -> torch.Tensor:
    return torch_mxfp4.dequantize(stack.blocks, stack.scales, stack.dtype)


def check_equals_dense_kernel(x, w13, w2, weights, ids, activation="silu", **kw):
    """Each decoded row is exactly the dequantized weight row (an FP4 value times a power
    of two is exact in bf16 and float32), and every output then runs the dense kernel's
    chain of operations (moe.h): the same bits."""
    got = cpu_moe.fused_moe_cpu(x, w13, w2, weights, ids, activation, **kw)
    want = cpu_moe.fused_moe_cpu(x, dense(w13), dense(w2), weights, ids, activation, **kw)
    assert got is not None and want is not None
    assert torch.equal(got, want)
    return got


@pytest.mark.parametrize("tokens", [1, 3, 64])
@pytest.mark.parametrize("experts, top_k", [(1, 1), (4, 2), (8, 1), (8, 4), (16, 8), (32, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_definition(tokens, experts, top_k, dtype):
    # hidden 160 / inter 96: five and three blocks a row, three gate items, a short last
    # down item (64, 64, 32 rows). Activation and biases vary with the case; the next
    # test crosses them all.
    activation = ACTIVATIONS[(tokens + experts + top_k) % 2]
    x, w13, w2, weights, ids, biases = make_case(
        tokens, experts, top_k, 160, 96, dtype, bias=(tokens + top_k) % 2 == 0,
        seed=tokens * 100 + experts * 10 + top_k)
    if top_k % 2:
        ids = ids.int()
    check_matches(x, w13, w2, weights, ids, activation, **biases)
    check_equals_dense_kernel(x, w13, w2, weights, ids, activation, **biases)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_activations_with_and_without_biases(activation, bias, dtype):
    # gates and ups past the swigluoai limit
    x, w13, w2, weights, ids, biases = make_case(37, 8, 4, 320, 128, dtype, bias=bias, seed=3)
    x = x * 4
    check_matches(x, w13, w2, weights, ids, activation, **biases)
    check_equals_dense_kernel(x, w13, w2, weights, ids, activation, **biases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_byte_and_a_range_of_scales_decode_as_the_definition(dtype):
    """Raw blocks: all 256 byte values (both nibbles of every code) at scales 2^-9..2^-3,
    rather than what a quantizer happens to produce."""
    g = torch.Generator().manual_seed(11)
    experts, hidden, inter = 4, 256, 64

    def raw(rows, cols):
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8,
                               generator=g)
        blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
        scales = torch.randint(118, 125, (experts, rows, cols // 32), dtype=torch.uint8,
                               generator=g)
        return Mxfp4Stack(blocks, scales, dtype)

    w13, w2 = raw(2 * inter, hidden), raw(hidden, inter)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    weights, ids = torch.topk(torch.randn(5, experts, generator=g).softmax(-1), 2)
    ids[0, 0] = 0  # the expert holding the 256 bytes
    check_matches(x, w13, w2, weights, ids, "swigluoai")
    check_equals_dense_kernel(x, w13, w2, weights, ids, "swigluoai")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_and_out_of_range_ids_contribute_nothing(dtype):
    """-1 (an expert-parallel rank's mark for an expert it does not hold) and any id
    outside [0, E) are skipped; a token with none left gets zeros."""
    x, w13, w2, weights, ids, biases = make_case(20, 8, 4, 96, 64, dtype, bias=True, seed=5)
    ids[::3, 1] = -1
    ids[1::4, 2] = 8
    ids[5] = -1
    got = check_matches(x, w13, w2, weights, ids, "swigluoai", **biases)
    assert torch.count_nonzero(got[5]) == 0
    kept = torch.where((ids >= 0) & (ids < 8), weights, torch.zeros_like(weights))
    torch.testing.assert_close(
        got, cpu_moe.fused_moe_cpu(x, w13, w2, kept, ids.clamp(0, 7), "swigluoai", **biases),
        rtol=0, atol=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_in_a_batch_of_300(activation, dtype):
    """Batch invariance: a row's bits do not depend on which rows share the call (how many
    share its experts, which thread decoded which rows, which token block)."""
    assert_rows_batch_invariant(make_case(300, 16, 4, 256, 128, dtype, bias=True, seed=8),
                                activation)


def test_declines_what_it_does_not_compute():
    """None (the door then runs the torch definition) rather than a wrong answer."""
    x, w13, w2, weights, ids, _ = make_case(3, 4, 2, 64, 32, torch.bfloat16)
    moe = cpu_moe.fused_moe_cpu
    assert moe(x, w13, w2, weights, ids) is not None
    assert moe(x.float(), w13, w2, weights, ids) is None  # stacks dequantize to bf16
    assert moe(x, w13, dense(w2), weights, ids) is None  # one MXFP4, one dense
    strided = w13.blocks.transpose(0, 1).contiguous().transpose(0, 1)
    assert moe(x, Mxfp4Stack(strided, w13.scales, w13.dtype), w2, weights, ids) is None
    assert moe(x, Mxfp4Stack(w13.blocks, w13.scales[:, :, :1].contiguous(), w13.dtype), w2,
               weights, ids) is None
    assert moe(x, w13, Mxfp4Stack(w2.blocks.int(), w2.scales, w2.dtype), weights, ids) is None
    assert moe(x, w13, w2, weights, ids, "gelu") is None


def test_the_door_runs_the_mxfp4_form_natively_and_by_the_definition(monkeypatch):
    """kernels.dispatch.fused_moe takes ExpertWeights holding Mxfp4Stacks: the native kernel
    on the CPU; without it, the torch definition, which dequantizes only the experts that
    got tokens, one at a time."""
    x, w13, w2, weights, ids, biases = make_case(6, 8, 2, 96, 64, torch.float32, bias=True,
                                                 seed=12)
    ids = ids % 4 * 2  # experts 0, 2, 4, 6 only
    experts = dispatch.ExpertWeights(w13, w2, biases["w13_bias"], biases["w2_bias"])
    native = cpu_moe.fused_moe_cpu(x, w13, w2, weights, ids, "swigluoai", **biases)
    assert torch.equal(dispatch.fused_moe(x, experts, weights, ids, "swigluoai"), native)

    indexed = []

    class Recording(Mxfp4Stack):
        __slots__ = ()

        def __getitem__(self, expert):
            indexed.append(expert)
            return super().__getitem__(expert)

    monkeypatch.setattr(dispatch_moe, "native_cpu_kernel", lambda: None)
    recording = dispatch.ExpertWeights(Recording(w13.blocks, w13.scales, w13.dtype),
                                       Recording(w2.blocks, w2.scales, w2.dtype),
                                       biases["w13_bias"], biases["w2_bias"])
    got = dispatch.fused_moe(x, recording, weights, ids, "swigluoai")
    assert sorted(indexed) == sorted(2 * sorted(set(ids.flatten().tolist())))
    # the definition on the dequantized dense stacks: the same torch ops, the same bits
    assert torch.equal(got, fused_moe(x, dense(w13), dense(w2), weights, ids, "swigluoai",
                                      **biases))
    torch.testing.assert_close(got, native, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CAN_DISASSEMBLE, reason="needs gcc and objdump")
@pytest.mark.parametrize("march, avx512, dpbf16", [(["-march=x86-64"], False, False),
                                                   (["-march=x86-64-v3"], False, False),
                                                   (["-march=x86-64-v4"], True, False),
                                                   (["-march=x86-64-v4", "-mavx512bf16"],
                                                    True, True)])
def test_every_isa_loop_builds_on_any_host(tmp_path, march, avx512, dpbf16):
    """The kernel builds at each level even where this CPU cannot run it; AVX-512 decodes
    by vpermps on zmm registers, and the BF16 build packs bf16 rows for vdpbf16ps."""
    disassembly = disassemble("moe_mxfp4.c", march, tmp_path)
    assert any("vpermps" in line and "zmm" in line for line in disassembly.splitlines()) == avx512
    assert ("vcvtne2ps2bf16" in disassembly) == dpbf16
    assert ("vdpbf16ps" in disassembly) == dpbf16
