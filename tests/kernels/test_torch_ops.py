"""The torch implementation (CPU production path) against plain dense attention."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import paged_attention, reshape_and_cache
from kernels import torch_ops
from testing.paged_batch import dense_attention, make_paged_batch

# bf16 inputs are identical on both sides; the gap is bf16 rounding of the logits
# and probabilities inside the implementation (outputs are O(1)).
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5),
             torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
             torch.float16: dict(atol=5e-3, rtol=5e-3)}


def assert_matches_dense(batch, dtype):
    out = paged_attention(*batch.attention_args())
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), dense_attention(batch), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2), (16, 8), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_batch_matches_dense(dtype, num_heads, num_kv_heads, block_size):
    seq_lens = [1, 7, block_size, block_size + 1, 3 * block_size - 1, 50]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, 64,
                             block_size, dtype=dtype, seed=block_size)
    assert_matches_dense(batch, dtype)


# Prefill chunks go through the decode kernel as rows up to ROWS_MAX_WORK, through
# SDPA past it: 0 sends every chunk of the tests to SDPA.
ROW_LIMITS = {"chunks as rows": torch_ops.ROWS_MAX_WORK, "chunks through SDPA": 0}


@pytest.mark.parametrize("rows_max_work", ROW_LIMITS.values(), ids=ROW_LIMITS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (9, 3), (16, 2)])
def test_mixed_prefill_decode_with_prefix_matches_dense(monkeypatch, rows_max_work, dtype, head_dim,
                                                        num_heads, num_kv_heads):
    monkeypatch.setattr(torch_ops, "ROWS_MAX_WORK", rows_max_work)
    # fresh prompt, chunk after a prefix-cache hit, decode rows, a one-token sequence
    seq_lens = [20, 45, 9, 1, 33, 16]
    query_lens = [20, 12, 1, 1, 5, 1]
    batch = make_paged_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, 16,
                             dtype=dtype, seed=head_dim)
    assert_matches_dense(batch, dtype)


def test_rows_and_sdpa_chunks_in_one_batch(monkeypatch):
    # 20 x 20 and 12 x 45 go as rows, 30 x 60 (work 1800) through SDPA.
    monkeypatch.setattr(torch_ops, "ROWS_MAX_WORK", 600)
    batch = make_paged_batch([20, 45, 9, 60], [20, 12, 1, 30], 9, 3, 64, 16, seed=5)
    assert_matches_dense(batch, torch.float32)


def test_prefill_only_batch_and_empty_query_chunk():
    batch = make_paged_batch([30, 12, 8], [30, 0, 3], 6, 2, 64, 8)
    assert_matches_dense(batch, torch.float32)


def test_rows_past_the_last_sequence_are_zero():
    batch = make_paged_batch([9, 4], [2, 1], 4, 2, 64, 8)
    padded = torch.cat([batch.query, torch.randn(3, 4, 64)])
    args = list(batch.attention_args())
    args[0] = padded
    out = paged_attention(*args)
    torch.testing.assert_close(out[:3], dense_attention(batch)[:3], **TOLERANCE[torch.float32])
    assert torch.equal(out[3:], torch.zeros(3, 4, 64))


def test_block_table_order_matters():
    # Swapping a full block with the partial last one changes which tokens lie past
    # seq_len: proves blocks are read in table order, not by luck of storage order.
    batch = make_paged_batch([28], [1], 2, 1, 64, 8)
    before = paged_attention(*batch.attention_args())
    batch.block_tables[0, [0, 3]] = batch.block_tables[0, [3, 0]]
    after = paged_attention(*batch.attention_args())
    assert not torch.allclose(before, after)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(),
       block_size=st.sampled_from([8, 16, 32]),
       heads=st.sampled_from([(2, 2), (6, 3), (8, 1), (16, 8)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_random_ragged_batches_match_dense(data, block_size, heads, dtype):
    rows_max_work = data.draw(st.sampled_from([0, 300, torch_ops.ROWS_MAX_WORK]), label="rows_max_work")
    num_seqs = data.draw(st.integers(1, 6), label="num_seqs")
    seq_lens = data.draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs),
                         label="seq_lens")
    query_lens = [data.draw(st.sampled_from([1, 1, length, data.draw(st.integers(0, length))]))
                  for length in seq_lens]
    batch = make_paged_batch(seq_lens, query_lens, heads[0], heads[1], 64, block_size,
                             dtype=dtype, seed=data.draw(st.integers(0, 2**16)))
    default, torch_ops.ROWS_MAX_WORK = torch_ops.ROWS_MAX_WORK, rows_max_work
    try:
        assert_matches_dense(batch, dtype)
    finally:
        torch_ops.ROWS_MAX_WORK = default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_slots_and_skips_padding(dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 8, 2, 64
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    value_cache = torch.randn_like(key_cache)
    key_before, value_before = key_cache.clone(), value_cache.clone()
    slots = torch.tensor([17, -1, 3, 40, -1, 47], dtype=torch.int64)
    key = torch.randn(6, kv_heads, head_dim).to(dtype)
    value = torch.randn(6, kv_heads, head_dim).to(dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    expected_k, expected_v = key_before.clone(), value_before.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[row]
            expected_v[slot // block_size, slot % block_size] = value[row]
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_cache_then_attend_round_trip():
    # The engine's order of calls: write the chunk's K/V, then attend over the cache.
    batch = make_paged_batch([12, 5], [4, 1], 4, 2, 64, 8)
    starts = batch.query_start_loc.tolist()
    slots, keys, values = [], [], []
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[seq + 1] - starts[seq]
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(batch.block_tables[seq, pos // 8]) * 8 + pos % 8)
        keys.append(batch.keys[seq][seq_len - q_len:])
        values.append(batch.values[seq][seq_len - q_len:])
        cache_slots = torch.tensor(slots[-q_len:])
        batch.key_cache.view(-1, 2, 64)[cache_slots] = 0.0  # forget them first
        batch.value_cache.view(-1, 2, 64)[cache_slots] = 0.0
    reshape_and_cache(torch.cat(keys), torch.cat(values), batch.key_cache, batch.value_cache,
                      torch.tensor(slots))
    assert_matches_dense(batch, torch.float32)


@pytest.mark.parametrize("field,mutate", [
    ("query", lambda a: a.update(query=a["query"][:, :, :32])),
    ("query", lambda a: a.update(query=a["query"][:, :3])),
    ("block_tables", lambda a: a.update(block_tables=a["block_tables"].float())),
    ("query_start_loc", lambda a: a.update(query_start_loc=a["query_start_loc"][:-1])),
    ("seq_lens", lambda a: a.update(seq_lens=torch.tensor([1, 9], dtype=torch.int32))),
    ("scale", lambda a: a.update(scale=-1.0)),
    ("max_seq_len", lambda a: a.update(max_seq_len=10_000)),
    ("value_cache", lambda a: a.update(value_cache=a["value_cache"][:, :4])),
    ("key_cache", lambda a: a.update(key_cache=a["key_cache"].transpose(1, 2))),
])
def test_paged_attention_rejects_bad_input_naming_the_field(field, mutate):
    batch = make_paged_batch([9, 4], [2, 1], 4, 2, 64, 8)
    names = ["query", "key_cache", "value_cache", "block_tables", "query_start_loc",
             "seq_lens", "scale", "max_query_len", "max_seq_len"]
    args = dict(zip(names, batch.attention_args()))
    mutate(args)
    with pytest.raises(ValueError, match=field):
        paged_attention(**args)


def test_reshape_and_cache_rejects_bad_input_naming_the_field():
    cache = torch.zeros(2, 8, 2, 64)
    key = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, key, cache, cache.clone(), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="key"):
        reshape_and_cache(key.double(), key.double(), cache, cache.clone(),
                          torch.zeros(3, dtype=torch.int64))
