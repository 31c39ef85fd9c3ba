"""The C kernels (CPU fast path: decode attention, the fused element-wise ops and KV
writes in bf16 and float32) against the torch implementations."""
import shutil
from types import SimpleNamespace

import pytest
import torch

from engine.models.rope import RotaryEmbedding
from kernels.cpu import native as cpu_native
from kernels import torch_ops
from testing.paged_batch import make_paged_batch
from testing.threads import torch_threads

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine falls back to torch")


def test_library_builds_and_loads():
    assert cpu_native.load_library() is not None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_matches_torch_decode(dtype, tol, num_heads, num_kv_heads, head_dim, block_size):
    seq_lens = [1, 5, block_size, block_size + 1, 3 * block_size + 2, 77]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim,
                             block_size, dtype=dtype, seed=head_dim + block_size)
    q, kc, vc, tables, _, lens, scale, *_ = batch.attention_args()
    expected = torch_ops.decode_attention(q, kc, vc, tables, lens, scale)
    got = cpu_native.decode_attention(q, kc, vc, tables, lens, scale)
    assert got is not None and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(32, 2, 64), (4, 2, 80), (4, 4, 48), (6, 2, 40), (2, 1, 160)])
def test_uncommon_shapes_match_torch_decode(dtype, tol, num_heads, num_kv_heads, head_dim):
    """The vector path takes head_dim a multiple of two vectors (32 on AVX-512 builds, 16
    on the others; <= 128) and <= 8 query heads per KV head, its common shapes compiled
    apart. 16 heads per KV head and head_dim 40 and 160 run the per-lane loop on every
    build; 80 and 48 run it on AVX-512 builds and the vector path's generic case on the
    others."""
    seq_lens = [1, 16, 33, 77]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim,
                             16, dtype=dtype, seed=head_dim)
    q, kc, vc, tables, _, lens, scale, *_ = batch.attention_args()
    expected = torch_ops.decode_attention(q, kc, vc, tables, lens, scale)
    got = cpu_native.decode_attention(q, kc, vc, tables, lens, scale)
    assert got is not None
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads():
    """batch_invariant relies on it: each sequence is one work item, summed in one order."""
    lens = [700, 1, 40, 333, 16, 17]
    batch = make_paged_batch(lens, [1] * len(lens), 9, 3, 64, 16, dtype=torch.bfloat16, seed=4)
    q, kc, vc, tables, _, seq_lens, scale, *_ = batch.attention_args()
    with torch_threads(1):
        together = cpu_native.decode_attention(q, kc, vc, tables, seq_lens, scale)
    for threads in (1, 2):
        with torch_threads(threads):
            for r in range(len(lens)):
                alone = cpu_native.decode_attention(q[r:r + 1], kc, vc, tables[r:r + 1],
                                                    seq_lens[r:r + 1], scale)
                assert torch.equal(alone, together[r:r + 1]), (r, threads)


def test_long_context_and_thread_split_match():
    batch = make_paged_batch([3000, 1, 700, 1500], [1] * 4, 9, 3, 64, 16, dtype=torch.float32, seed=1)
    q, kc, vc, tables, _, lens, scale, *_ = batch.attention_args()
    expected = torch_ops.decode_attention(q, kc, vc, tables, lens, scale)
    for threads in (1, 3):
        with torch_threads(threads):
            got = cpu_native.decode_attention(q, kc, vc, tables, lens, scale)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_unsupported_dtype_declines():
    batch = make_paged_batch([5, 9], [1, 1], 4, 2, 64, 8, dtype=torch.float16)
    q, kc, vc, tables, _, lens, scale, *_ = batch.attention_args()
    assert cpu_native.decode_attention(q, kc, vc, tables, lens, scale) is None


def test_loading_the_kernel_does_not_flush_subnormals():
    # A library linked with -ffast-math would switch on flush-to-zero process-wide.
    assert cpu_native.load_library() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


def _bf16_close(got, expected):
    # Same rounding steps as the torch chain; only float32 summation order and exp's
    # last bit may differ, i.e. at most one bf16 ulp on a rare element.
    diff = (got.float() - expected.float()).abs()
    ulp = expected.float().abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool((diff <= ulp).all())
    assert (got == expected).float().mean().item() > 0.99


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 64), (64, 1024)])
def test_fused_add_rms_norm_matches_torch_chain(rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    residual = (3 * torch.randn(rows, hidden, generator=g)).to(torch.bfloat16)
    weight = torch.randn(hidden, generator=g).to(torch.bfloat16)
    expected_res = residual.clone().add_(x)
    expected = torch.nn.functional.rms_norm(expected_res.float(), (hidden,), None, 1e-5)
    expected = expected.to(torch.bfloat16) * weight
    got_res = residual.clone()
    got = cpu_native.add_rms_norm(x, got_res, weight, 1e-5)
    assert torch.equal(got_res, expected_res)
    _bf16_close(got, expected)
    # Without x: normalise the residual as it is.
    alone = cpu_native.add_rms_norm(None, expected_res.clone(), weight, 1e-5)
    _bf16_close(alone, expected)


def test_fused_silu_mul_matches_torch_chain():
    gate_up = (4 * torch.randn(33, 2 * 384, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    expected = torch.nn.functional.silu(gate_up[:, :384]).mul_(gate_up[:, 384:])
    _bf16_close(cpu_native.silu_mul(gate_up), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_silu_mul_saturates_without_nan(dtype):
    # exp(-gate) overflows float32 below about -88.7; silu is ~0 there, never NaN.
    # 9 columns: the last one goes through the scalar tail of the vectorized loop.
    gate = torch.tensor([[-90.0, -200.0, 90.0, 1e30, 0.0, -88.0, 88.0, -3.0, -1e30]])
    gate_up = torch.cat((gate, torch.full_like(gate, 2.0)), dim=1).to(dtype)
    got = cpu_native.silu_mul(gate_up).float()
    expected = torch_ops.silu_mul(gate_up.float())
    torch.testing.assert_close(got, expected, atol=1e-30, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_takes_the_first_maximum(dtype):
    logits = torch.randn(9, 5000, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[3, 17] = logits[3, 4000] = 50.0  # a tie: the first index wins, as in torch
    logits[5, :] = -1.0
    # ties on both sides of the kernel's 256-wide block edge, and in a later block only
    logits[6, 255] = logits[6, 256] = logits[6, 4999] = 60.0
    logits[7, 300] = logits[7, 511] = 70.0
    logits[8, :] = -float("inf")  # a fully masked row: torch answers 0
    got = cpu_native.argmax_rows(logits)
    assert torch.equal(got, logits.float().argmax(dim=-1))
    assert [got[i].item() for i in (3, 5, 6, 7, 8)] == [17, 0, 255, 300, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [1, 7, 255, 256, 257, 49152])
def test_argmax_rows_at_block_edges(dtype, cols):
    logits = torch.randn(5, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
    logits[1, -1] = 100.0  # the maximum in the last, possibly partial, block
    got = cpu_native.argmax_rows(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[1] == cols - 1
    # one row: the kernel runs it on the calling thread
    assert torch.equal(cpu_native.argmax_rows(logits[1:2]), logits[1:2].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_elementwise_kernels_decline_other_dtypes(dtype):
    x = torch.randn(4, 64).to(dtype)
    assert cpu_native.add_rms_norm(None, x, torch.ones(64, dtype=dtype), 1e-5) is None
    assert cpu_native.silu_mul(x) is None
    assert cpu_native.argmax_rows(x) is None
    table = torch.randn(10, 16).to(dtype)
    assert cpu_native.rope(x, 1, 64, 16, torch.zeros(4, dtype=torch.int64), table, table) is None
    # Mixed dtypes decline too: the kernel reads every operand as the residual's dtype.
    assert cpu_native.add_rms_norm(None, torch.randn(4, 64), torch.ones(64, dtype=dtype), 1e-5) is None


@pytest.mark.parametrize("rot_half", [32, 16])  # full and partial rotary
def test_fused_rope_matches_torch_expression(rot_half):
    g = torch.Generator().manual_seed(rot_half)
    rows, heads, dim = 11, 5, 64
    qkv = torch.randn(rows, (heads + 2) * dim, generator=g).to(torch.bfloat16)  # fused row layout
    cos = torch.randn(100, rot_half, generator=g).to(torch.bfloat16)
    sin = torch.randn(100, rot_half, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 100, (rows,), generator=g)
    x = qkv[:, :heads * dim].view(rows, heads, dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x[..., :rot_half], x[..., rot_half:2 * rot_half]
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * rot_half:]), dim=-1)
    got = cpu_native.rope(qkv, heads, dim, rot_half, positions, cos, sin)
    assert torch.equal(got, expected)


def test_fused_reshape_and_cache_matches_torch_and_skips_padding():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 5 * 64, generator=g).to(torch.bfloat16)  # strided K/V views, as the model passes
    key = qkv[:, 3 * 64:4 * 64].view(6, 1, 64)
    value = qkv[:, 4 * 64:].view(6, 1, 64)
    slots = torch.tensor([5, 0, -1, 17, 3, -1])
    expected = [torch.zeros(4, 8, 1, 64, dtype=torch.bfloat16) for _ in range(2)]
    torch_ops.reshape_and_cache(key, value, *expected, slots)
    got = [torch.zeros(4, 8, 1, 64, dtype=torch.bfloat16) for _ in range(2)]
    assert cpu_native.reshape_and_cache(key, value, *got, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert not cpu_native.reshape_and_cache(key.double(), value.double(),
                                            *(c.double() for c in got), slots)


# float32: the dtype the engine runs in on CPUs without native bf16. No bf16 rounding
# steps to reproduce, so the results only differ from torch by the order of float32 sums
# and exp's last bits; rope and the KV copy are bit-equal. Row counts cover one decode
# row (single-threaded) and enough work to run on several threads.
F32 = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (1, 577), (37, 577), (64, 1024), (3, 7)])
def test_fused_add_rms_norm_f32_matches_reference(rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g)
    residual = 3 * torch.randn(rows, hidden, generator=g)
    x[-1] *= 1e-3
    residual[-1] *= 1e-3  # mean square near eps: a row where eps matters
    weight = torch.randn(hidden, generator=g)
    expected_res = residual.clone()
    expected = torch_ops.add_rms_norm(x, expected_res, weight, 1e-5)
    got_res = residual.clone()
    got = cpu_native.add_rms_norm(x, got_res, weight, 1e-5)
    assert got is not None and got.dtype == torch.float32 and got.shape == (rows, hidden)
    assert torch.equal(got_res, expected_res)  # the residual add is one exact float32 add
    torch.testing.assert_close(got, expected, **F32)
    # Without x: the residual is normalised as it is and left unchanged.
    alone_res = expected_res.clone()
    alone = cpu_native.add_rms_norm(None, alone_res, weight, 1e-5)
    assert torch.equal(alone_res, expected_res)
    torch.testing.assert_close(alone, expected, **F32)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (1, 577), (37, 577), (4, 3)])
def test_fused_silu_mul_f32_matches_reference(rows, inter):
    gate_up = 4 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter))
    gate_up[0, :2] = torch.tensor([-90.0, 90.0])  # exp overflows / underflows on one side
    expected = torch_ops.silu_mul(gate_up)
    got = cpu_native.silu_mul(gate_up)
    assert got is not None and got.shape == (rows, inter) and got.is_contiguous()
    torch.testing.assert_close(got, expected, **F32)


@pytest.mark.parametrize("rot_half", [32, 16])  # full and partial rotary
@pytest.mark.parametrize("rows,heads", [(1, 12), (37, 12), (11, 5)])
def test_fused_rope_f32_is_bit_equal_to_reference(rows, heads, rot_half):
    g = torch.Generator().manual_seed(rows + rot_half)
    dim = 64
    qkv = torch.randn(rows, (heads + 3) * dim, generator=g)  # fused row layout
    cos = torch.randn(100, rot_half, generator=g)
    sin = torch.randn(100, rot_half, generator=g)
    positions = torch.randint(0, 100, (rows,), generator=g)
    expected = torch_ops.rope(qkv, heads, dim, cos[positions].unsqueeze(1),
                              sin[positions].unsqueeze(1))
    got = cpu_native.rope(qkv, heads, dim, rot_half, positions, cos, sin)
    # torch rounds each product before the sum; an FMA-contracted kernel would not.
    assert got is not None and got.is_contiguous()
    assert torch.equal(got, expected)


def test_fused_rope_f32_takes_the_model_tables():
    # RotaryEmbedding builds its tables in the model dtype: float32 for a float32 model.
    config = SimpleNamespace(hidden_size=576, num_attention_heads=9, head_dim=64,
                             max_position_embeddings=512, rope_theta=10000.0,
                             partial_rotary_factor=0.5)
    rotary = RotaryEmbedding(config, torch.float32)
    assert rotary.cos.dtype == torch.float32 and rotary.rot_half == 16
    positions = torch.tensor([0, 5, 511, 200])
    qkv = torch.randn(4, 12 * 64, generator=torch.Generator().manual_seed(0))
    cos, sin, _ = rotary.lookup(positions)
    expected = torch_ops.rope(qkv, 12, 64, cos, sin)
    got = cpu_native.rope(qkv, 12, 64, rotary.rot_half, positions, rotary.cos, rotary.sin)
    assert got is not None and torch.equal(got, expected)


@pytest.mark.parametrize("tokens,kv_heads", [(6, 1), (300, 2)])
def test_fused_reshape_and_cache_f32_matches_reference(tokens, kv_heads):
    g = torch.Generator().manual_seed(tokens)
    dim, blocks, block_size = 64, 40, 8
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * dim, generator=g)  # strided K/V views
    key = qkv[:, 4 * dim:(4 + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = qkv[:, (4 + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[::3] = -1  # padding
    expected = [torch.zeros(blocks, block_size, kv_heads, dim) for _ in range(2)]
    torch_ops.reshape_and_cache(key, value, *expected, slots)
    got = [torch.zeros(blocks, block_size, kv_heads, dim) for _ in range(2)]
    assert cpu_native.reshape_and_cache(key, value, *got, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
