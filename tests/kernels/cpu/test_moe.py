"""The native fused-MoE kernel (kernels/cpu/moe.c) against its definition,
kernels/torch_moe.fused_moe: token counts from one to a prefill chunk, experts that
receive nothing, ids an expert-parallel rank masks out, both activations with and without
biases, float32 and bf16; a row's bits alone and inside a batch; and what it declines.

Run it under TLE_CPU_ISA=avx2 and =baseline too: the build then carries the portable
widen-and-FMA loop instead of vdpbf16ps (row_dot.h), which these same tests then check.
"""
import shutil

import pytest
import torch

from kernels.cpu import moe as cpu_moe
from kernels.torch_moe import ACTIVATIONS, fused_moe
from testing.native_build import CAN_DISASSEMBLE, disassemble

pytestmark = pytest.mark.skipif(
    (shutil.which("cc") is None and shutil.which("gcc") is None) or cpu_moe._library() is None,
    reason="no C compiler: the engine falls back to torch")


def make_case(tokens, experts, top_k, hidden, inter, dtype, bias=False, seed=0,
              ids_dtype=torch.int64):
    """Weights scaled so every stage stays O(1) (the activations and sums are then in the
    range where bf16 rounding, not overflow, is what differs), and each token's top_k
    distinct experts from random router logits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    biases = {}
    if bias:
        biases = {"w13_bias": torch.randn(experts, 2 * inter, generator=g).to(dtype),
                  "w2_bias": torch.randn(experts, hidden, generator=g).to(dtype)}
    return x, w13, w2, weights, ids.to(ids_dtype), biases


def check_matches(x, w13, w2, weights, ids, activation="silu", **kw):
    expected = fused_moe(x, w13, w2, weights, ids, activation, **kw)
    got = cpu_moe.fused_moe_cpu(x, w13, w2, weights, ids, activation, **kw)
    assert got is not None and got.dtype == x.dtype and got.shape == expected.shape
    scale = max(float(expected.float().abs().max()), 1.0)
    if x.dtype == torch.float32:
        # the same float32 math summed in another order: a few float32 ulps
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
        return got
    # bf16: torch's matmuls and these sum in different orders, so now and then an
    # intermediate (h, the activation, y) rounds to the neighbouring bf16 value; the
    # result then moves by about one rounding of the largest value, and nearly all
    # elements are still the same bits.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7,
                               atol=2 ** -8 * scale)
    assert float((got != expected).float().mean()) < 0.01
    return got


@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("experts, top_k", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2),
                                            (8, 4), (8, 8), (16, 1), (16, 2), (16, 4), (16, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_definition(tokens, experts, top_k, dtype):
    # hidden 72 / inter 40: vector loops with tails, a short group of W rows and a short
    # last work item in each projection. Activation and biases vary with the case; the
    # next test crosses them all.
    activation = ACTIVATIONS[(tokens + experts + top_k) % 2]
    x, w13, w2, weights, ids, biases = make_case(
        tokens, experts, top_k, 72, 40, dtype, bias=(tokens + top_k) % 3 == 0,
        seed=tokens * 100 + experts * 10 + top_k,
        ids_dtype=torch.int32 if top_k % 2 else torch.int64)
    check_matches(x, w13, w2, weights, ids, activation, **biases)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_activations_with_and_without_biases(activation, bias, dtype):
    # hidden 300: the final sum's row in more than one block, k = 576 for the
    # gate_up dot products (18 vdpbf16ps steps); gates and ups past the swigluoai limit
    x, w13, w2, weights, ids, biases = make_case(37, 8, 4, 300, 96, dtype, bias=bias, seed=3)
    x = x * 4
    check_matches(x, w13, w2, weights, ids, activation, **biases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swigluoai_alpha_and_limit_are_used(dtype):
    x, w13, w2, weights, ids, biases = make_case(9, 4, 2, 64, 32, dtype, bias=True, seed=4)
    x = x * 4
    out = check_matches(x, w13, w2, weights, ids, "swigluoai", alpha=1.0, limit=0.5, **biases)
    default = cpu_moe.fused_moe_cpu(x, w13, w2, weights, ids, "swigluoai", **biases)
    assert not torch.equal(out, default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_and_out_of_range_ids_contribute_nothing(dtype):
    """An expert-parallel rank writes -1 for experts it does not hold; any id outside
    [0, E) is skipped, and a token with none left gets zeros."""
    x, w13, w2, weights, ids, _ = make_case(20, 8, 4, 72, 40, dtype, seed=5)
    ids[::3, 1] = -1
    ids[1::4, 2] = 8
    ids[5] = -1
    got = check_matches(x, w13, w2, weights, ids)
    assert torch.count_nonzero(got[5]) == 0
    # the same as dropping those slots' weights
    kept = torch.where((ids >= 0) & (ids < 8), weights, torch.zeros_like(weights))
    clamped = ids.clamp(0, 7)
    torch.testing.assert_close(got, cpu_moe.fused_moe_cpu(x, w13, w2, kept, clamped),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_without_tokens_and_a_repeated_expert(dtype):
    """Only even experts routed (half the experts receive nothing), and one token sent to
    the same expert in two slots: both slots count."""
    x, w13, w2, weights, ids, _ = make_case(16, 16, 4, 72, 40, dtype, seed=6)
    ids = (ids // 2) * 2
    ids[3] = torch.tensor([6, 6, 2, 6])
    check_matches(x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_larger_than_one_chunk(dtype):
    """hidden 8192 at top-8 needs ~260 KB of scratch a token, so 300 tokens run as two
    chunks of the 64 MB budget (each reading the experts again)."""
    x, w13, w2, weights, ids, biases = make_case(300, 8, 8, 8192, 32, dtype, bias=True, seed=7)
    check_matches(x, w13, w2, weights, ids, "swigluoai", **biases)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_in_a_batch_of_300(activation, dtype):
    """Batch invariance: each row is one fixed chain of operations, so its bits do not
    depend on which rows share the call (how many share its experts, which thread, which
    token block). Large enough that both calls run threaded and experts get > 16 tokens."""
    assert_rows_batch_invariant(make_case(300, 16, 4, 256, 128, dtype, bias=True, seed=8),
                                activation)


def assert_rows_batch_invariant(case, activation: str) -> None:
    """Rows of a 300-row case alone, and among other neighbours, equal their batch rows
    bitwise (shared by the MXFP4 kernel's test)."""
    x, w13, w2, weights, ids, biases = case
    batch = cpu_moe.fused_moe_cpu(x, w13, w2, weights, ids, activation, **biases)
    for row in (0, 1, 77, 150, 299):
        alone = cpu_moe.fused_moe_cpu(x[row:row + 1], w13, w2, weights[row:row + 1],
                                      ids[row:row + 1], activation, **biases)
        assert torch.equal(alone[0], batch[row]), row
    # and in a batch of different neighbours
    rows = torch.tensor([299, 5, 150])
    again = cpu_moe.fused_moe_cpu(x[rows], w13, w2, weights[rows], ids[rows], activation,
                                  **biases)
    assert torch.equal(again, batch[rows])


def test_router_weights_in_any_float_dtype_are_used_in_float32():
    x, w13, w2, weights, ids, _ = make_case(5, 4, 2, 64, 32, torch.bfloat16, seed=9)
    half = weights.bfloat16()
    torch.testing.assert_close(cpu_moe.fused_moe_cpu(x, w13, w2, half, ids),
                               cpu_moe.fused_moe_cpu(x, w13, w2, half.float(), ids),
                               rtol=0, atol=0)


def test_no_tokens():
    x, w13, w2, weights, ids, _ = make_case(0, 4, 2, 64, 32, torch.float32)
    got = cpu_moe.fused_moe_cpu(x, w13, w2, weights, ids)
    assert got is not None and got.shape == (0, 64)


def test_declines_what_it_does_not_compute():
    """None (the dispatch door then runs torch) rather than a wrong answer."""
    x, w13, w2, weights, ids, biases = make_case(3, 4, 2, 64, 32, torch.bfloat16, bias=True)
    moe = cpu_moe.fused_moe_cpu
    assert moe(x.half(), w13.half(), w2.half(), weights, ids) is None
    assert moe(x.float(), w13, w2, weights, ids) is None  # weights not in x's dtype
    assert moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids) is None
    assert moe(x, w13, w2[:, :, :16], weights, ids) is None  # w2 does not match w13
    assert moe(x, w13, w2, weights, ids, w13_bias=biases["w13_bias"].float()) is None
    assert moe(x, w13, w2, weights, ids, w2_bias=biases["w2_bias"][:, :10]) is None
    assert moe(x, w13, w2, weights, ids, "gelu") is None
    assert moe(x, w13, w2, weights, ids.float()) is None
    assert moe(x, w13, w2, weights[:2], ids) is None


@pytest.mark.skipif(not CAN_DISASSEMBLE, reason="needs gcc and objdump")
@pytest.mark.parametrize("march, dpbf16", [(["-march=x86-64"], False),
                                           (["-march=x86-64-v3"], False),
                                           (["-march=x86-64-v4", "-mavx512bf16"], True)])
def test_every_isa_loop_builds_on_any_host(tmp_path, march, dpbf16):
    """The kernel builds at each level even where this CPU cannot run it (the tests above
    run only this host's and its caps'), and the AVX-512 BF16 build really multiplies
    with vdpbf16ps (row_dot.h), the others with float32 FMA."""
    disassembly = disassemble("moe.c", march, tmp_path)
    assert ("vdpbf16ps" in disassembly) == dpbf16
