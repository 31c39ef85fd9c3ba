"""Each Triton kernel against the torch implementation (kernels.torch_ops).

Without CUDA the kernels run under the Triton interpreter: TRITON_INTERPRET=1 must be
set before triton (and our kernel modules) are imported, so it is set right here at
import time when no GPU is present. It stays set for the rest of the pytest process.
The interpreter is slow (~5 ms per program-iteration), hence the tiny shapes and small
tiles (AttentionTiles) chosen so tiles span pages and contexts span partitions.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed; the torch path is tested "
                    "in test_kernels_torch.py")

from kernels import torch_ops  # noqa: E402
from kernels.triton import ops as triton_ops
from testing.paged_batch import make_paged_batch  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
# The two sides round differently in bf16/fp16: torch keeps bf16 logits, the kernels
# fp32 ones; both round probabilities to the value dtype before P @ V.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
             torch.float16: dict(atol=1e-2, rtol=1e-2)}
SMALL_TILES = triton_ops.AttentionTiles(block_n=16, block_m=16, partition_size=32)


def assert_kernel_matches_torch(batch, dtype, tiles):
    expected = torch_ops.paged_attention(*[a.cpu() if isinstance(a, torch.Tensor) else a
                                           for a in batch.attention_args()])
    out = triton_ops.paged_attention(*batch.attention_args(), tiles=tiles)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.cpu().float(), expected.float(), **TOLERANCE[dtype])


# (query heads per KV head, head_dim, block_size, dtype): every value of each axis
# appears with several others instead of the full product, to bound interpreter time.
CASES = [(1, 64, 8, torch.float32), (3, 64, 16, torch.bfloat16), (8, 128, 32, torch.float16),
         (3, 128, 8, torch.float32), (8, 64, 16, torch.bfloat16), (1, 128, 32, torch.bfloat16),
         (8, 64, 8, torch.float32)]


@pytest.mark.parametrize("ratio,head_dim,block_size,dtype", CASES)
@pytest.mark.parametrize("tiles", [SMALL_TILES, triton_ops.DEFAULT_TILES], ids=["split", "single"])
def test_decode_kernel_matches_torch(ratio, head_dim, block_size, dtype, tiles):
    # ragged: 1 token, partial last block, exactly one partition, spanning three
    seq_lens = [1, block_size + 3, 32, 70, 9]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), 2 * ratio, 2, head_dim, block_size,
                             dtype=dtype, device=DEVICE, seed=ratio * block_size)
    assert_kernel_matches_torch(batch, dtype, tiles)


@pytest.mark.parametrize("ratio,head_dim,block_size,dtype", CASES)
def test_prefill_kernel_with_prefix_and_decode_rows_matches_torch(ratio, head_dim, block_size,
                                                                  dtype):
    # fresh prompt, chunk after a cached prefix, decode rows, an idle (q_len 0) sequence
    seq_lens = [19, 40, 7, 12, 1]
    query_lens = [19, 11, 1, 0, 1]
    batch = make_paged_batch(seq_lens, query_lens, 2 * ratio, 2, head_dim, block_size,
                             dtype=dtype, device=DEVICE, seed=ratio + head_dim)
    assert_kernel_matches_torch(batch, dtype, SMALL_TILES)


@pytest.mark.parametrize("ratio,head_dim,block_size,dtype", CASES[:3])
def test_prefill_kernel_with_speculative_verification_rows_matches_torch(ratio, head_dim,
                                                                         block_size, dtype):
    # Decodes verifying drafts (speculative decoding): a few query tokens at the end of
    # long contexts, beside plain decode rows.
    seq_lens = [70, 9, 45, 33]
    query_lens = [5, 1, 9, 2]
    batch = make_paged_batch(seq_lens, query_lens, 2 * ratio, 2, head_dim, block_size,
                             dtype=dtype, device=DEVICE, seed=ratio + block_size)
    assert_kernel_matches_torch(batch, dtype, SMALL_TILES)


def test_prefill_kernel_with_default_tiles_and_padding_rows():
    batch = make_paged_batch([37, 5], [30, 5], 6, 2, 64, 16, device=DEVICE)
    padded_query = torch.cat([batch.query, torch.randn(2, 6, 64, device=DEVICE)])
    args = list(batch.attention_args())
    args[0] = padded_query
    out = triton_ops.paged_attention(*args)
    expected = torch_ops.paged_attention(*[a.cpu() if isinstance(a, torch.Tensor) else a
                                           for a in args])
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[torch.float32])
    assert torch.equal(out[-2:].cpu(), torch.zeros(2, 6, 64))


def test_decode_partitions_past_a_short_sequence_are_ignored():
    # max_seq_len gives 4 partitions but most sequences use one: their unused
    # partition slots hold garbage that the reduce must not read.
    batch = make_paged_batch([3, 128, 17], [1, 1, 1], 4, 1, 64, 16, device=DEVICE)
    assert_kernel_matches_torch(batch, torch.float32, SMALL_TILES)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([8, 16, 32]),
       heads=st.sampled_from([(2, 2), (6, 2), (8, 1)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_random_ragged_batches_match_torch(data, block_size, heads, dtype, index_dtype):
    num_seqs = data.draw(st.integers(1, 4), label="num_seqs")
    seq_lens = data.draw(st.lists(st.integers(1, 40), min_size=num_seqs, max_size=num_seqs),
                         label="seq_lens")
    decode_only = data.draw(st.booleans(), label="decode_only")
    query_lens = [1 if decode_only else data.draw(st.integers(0, length)) for length in seq_lens]
    batch = make_paged_batch(seq_lens, query_lens, heads[0], heads[1], 64, block_size,
                             dtype=dtype, device=DEVICE, seed=data.draw(st.integers(0, 2**16)))
    batch.block_tables = batch.block_tables.to(index_dtype)
    batch.query_start_loc = batch.query_start_loc.to(index_dtype)
    batch.seq_lens = batch.seq_lens.to(index_dtype)
    assert_kernel_matches_torch(batch, dtype, SMALL_TILES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 128), (8, 64)])
def test_reshape_and_cache_kernel_matches_torch(dtype, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_kv_heads)
    cache = torch.randn(5, 8, num_kv_heads, head_dim, generator=gen).to(dtype)
    # K/V as strided views of a fused projection output, like the model produces
    fused = torch.randn(7, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.tensor([0, -1, 39, 8, -1, 17, 31], dtype=torch.int64)
    expected_k, expected_v = cache.clone(), cache.clone()
    torch_ops.reshape_and_cache(key, value, expected_k, expected_v, slots)
    key_cache, value_cache = cache.to(DEVICE), cache.clone().to(DEVICE)
    triton_ops.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache,
                                 slots.to(DEVICE))
    assert torch.equal(key_cache.cpu(), expected_k)
    assert torch.equal(value_cache.cpu(), expected_v)


def test_tiles_reject_bad_sizes():
    with pytest.raises(ValueError, match="block_n"):
        triton_ops.AttentionTiles(block_n=24)
    with pytest.raises(ValueError, match="partition_size"):
        triton_ops.AttentionTiles(block_n=64, partition_size=96)


@pytest.mark.parametrize("sms", [1, 4, 132])
def test_decode_split_fills_the_device_only_when_the_batch_does_not(sms):
    for num_seqs, num_kv_heads in [(1, 1), (1, 8), (3, 2), (64, 8), (256, 1)]:
        programs = num_seqs * num_kv_heads
        for max_seq_len in [1, 100, 255, 256, 257, 1000, 4096, 32768, 131072]:
            size = triton_ops.decode_partition_size(num_seqs, num_kv_heads, max_seq_len, sms, 64)
            parts = -(-max_seq_len // size)
            assert size & (size - 1) == 0 and size >= triton_ops.MIN_PARTITION_SIZE
            if programs >= triton_ops.PROGRAMS_PER_SM * sms:
                assert parts == 1  # the unsplit grid already fills the SMs
            else:
                # as many programs as wanted, unless partitions would get too short
                assert programs * parts <= 2 * triton_ops.PROGRAMS_PER_SM * sms
                assert (programs * parts * 2 > triton_ops.PROGRAMS_PER_SM * sms
                        or size == triton_ops.MIN_PARTITION_SIZE)


@pytest.mark.parametrize("tiles", [triton_ops.DEFAULT_TILES, SMALL_TILES], ids=["auto", "fixed"])
def test_warm_up_covers_every_variant_a_server_can_meet(tiles):
    """Brute force over batches within the limits: each variant paged_attention would
    compile is one the start-up warm-up launches (no JIT stall while serving)."""
    from kernels.triton import warmup as triton_warmup
    max_model_len, max_tokens = 3000, 700
    lengths = sorted({*range(1, max_model_len + 1, 37), *(2**k + d for k in range(12)
                                                          for d in (-1, 0, 1)), max_model_len})
    lengths = [n for n in lengths if 1 <= n <= max_model_len]
    for group in (1, 3, 8):
        warmed = {case.key for case in triton_warmup.warm_up_cases(group, max_model_len,
                                                                      max_tokens, tiles)}
        met = set()
        for sms in (1, 16, 132):
            for num_kv_heads in (1, 2, 8):
                for num_seqs in (1, 2, 3, 5, 8, 17, 64):
                    met.update(triton_warmup.variant(num_seqs, num_kv_heads, group, 1, n, sms,
                                                     tiles) for n in lengths)
        met.update(triton_warmup.variant(1, 1, group, q, q, 1, tiles)
                   for q in range(2, max_tokens + 1))
        assert met <= warmed, f"group {group}: not warmed up: {met - warmed}"
        # each case launches the variant it is listed for
        for case in triton_warmup.warm_up_cases(group, max_model_len, max_tokens, tiles):
            assert triton_warmup.variant(1, 1, group, case.max_query_len, case.seq_len, 1,
                                         case.tiles) == case.key


def test_warm_up_launches_run():
    from kernels.triton import warmup as triton_warmup
    cases = triton_warmup.warm_up_attention(4, 2, 16, 8, torch.float32, torch.device(DEVICE),
                                            max_model_len=600, max_num_batched_tokens=20,
                                            tiles=SMALL_TILES)
    assert {c.key[0] for c in cases} == {"decode", "prefill"}


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: on CPU the dispatcher runs the torch path")
def test_dispatch_runs_triton_on_cuda():
    import kernels
    batch = make_paged_batch([20, 9], [4, 1], 6, 2, 64, 16, device="cuda")
    out = kernels.paged_attention(*batch.attention_args())
    assert out.is_cuda
    expected = torch_ops.paged_attention(*[a.cpu() if isinstance(a, torch.Tensor) else a
                                           for a in batch.attention_args()])
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[torch.float32])


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: on CPU the dispatcher runs the C/torch path")
def test_dispatch_elementwise_ops_on_cuda_run_the_torch_reference():
    from kernels import dispatch
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    weight = torch.randn(64, generator=g).to(torch.bfloat16).cuda()
    expected_residual = residual.clone()
    expected = torch_ops.add_rms_norm(x, expected_residual, weight, 1e-5)
    assert torch.equal(dispatch.add_rms_norm(x, residual, weight, 1e-5), expected)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(dispatch.silu_mul(x), torch_ops.silu_mul(x))
    assert torch.equal(dispatch.argmax_rows(x), x.argmax(dim=-1))
    tables = [torch.randn(40, 8, generator=g).to(torch.bfloat16).cuda() for _ in range(2)]
    positions = torch.tensor([3, 0, 39, 7, 7], device="cuda")
    cos, sin = (t[positions].unsqueeze(1) for t in tables)
    got = dispatch.rope(x, 2, 16, 8, positions, *tables, cos, sin)
    assert got.is_cuda and torch.equal(got, torch_ops.rope(x, 2, 16, cos, sin))
