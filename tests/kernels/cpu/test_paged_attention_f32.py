"""The paged attention kernel (kernels/cpu/paged_attention_f32.c), float32 and bf16, against
the dense reference, and the property its tiles are built for: a query row's result is the
same bits whatever chunk or tile it comes in, and as a decode row."""
import shutil

import pytest
import torch

from kernels import dispatch, torch_ops
from kernels.dispatch import attention as attention_dispatch
from kernels.cpu import paged_attention as cpu_attention
from kernels.cpu.paged_attention import paged_attention, paged_attention_f32
from testing.paged_batch import dense_attention, make_paged_batch
from testing.threads import torch_threads

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine falls back to torch")


def _run(batch):
    q, kc, vc, tables, starts, lens, scale, *_ = batch.attention_args()
    return paged_attention_f32(q, kc, vc, tables, starts, lens, scale)


# Decode rows, a fresh prompt, chunks after cached context (ending inside and on block
# edges), a one-token chunk, a chunk of exactly one tile and a sequence without rows.
SEQ_LENS = [7, 40, 33, 64, 1, 90, 12, 5]
QUERY_LENS = [1, 40, 17, 31, 1, 1, 5, 0]


# GQA (SmolLM2's 9/3), MHA, MQA and groups of a whole tile; head_dim 40 runs the
# kernel's generic width; block sizes below and above the 4-key score groups.
SHAPES = pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (9, 3, 64, 1), (9, 3, 40, 4), (4, 4, 128, 32), (8, 1, 64, 16),
    (32, 2, 128, 16), (32, 2, 40, 1), (6, 2, 64, 8)])


@SHAPES
def test_matches_dense_attention(num_heads, num_kv_heads, head_dim, block_size):
    batch = make_paged_batch(SEQ_LENS, QUERY_LENS, num_heads, num_kv_heads, head_dim,
                             block_size, seed=head_dim + block_size + num_heads)
    got = _run(batch)
    assert got is not None
    torch.testing.assert_close(got, dense_attention(batch), atol=2e-5, rtol=2e-5)


@SHAPES
def test_bf16_is_the_float32_arithmetic_on_its_widened_inputs(num_heads, num_kv_heads,
                                                              head_dim, block_size):
    batch = make_paged_batch(SEQ_LENS, QUERY_LENS, num_heads, num_kv_heads, head_dim,
                             block_size, dtype=torch.bfloat16,
                             seed=head_dim + block_size + num_heads)
    q, kc, vc, tables, starts, lens, scale, *_ = batch.attention_args()
    got = paged_attention(q, kc, vc, tables, starts, lens, scale)
    assert got is not None and got.dtype == torch.bfloat16
    # Widening is exact and the rounding is torch's (nearest-even): the same bits as the
    # float32 kernel on the same values.
    wide = paged_attention_f32(q.float(), kc.float(), vc.float(), tables, starts, lens, scale)
    assert torch.equal(got, wide.to(torch.bfloat16))
    # Within half a bf16 ulp of float32 SDPA on the same inputs (rounding the output is
    # the only bf16 step), and close to torch's own bf16 path.
    torch.testing.assert_close(got.float(), dense_attention(batch), atol=1e-4, rtol=2 ** -8)
    reference = torch_ops.paged_attention(*batch.attention_args())
    torch.testing.assert_close(got, reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_in_any_chunk_and_as_a_decode_row(dtype):
    seq_len = 150
    whole = make_paged_batch([seq_len], [seq_len], 9, 3, 64, 16, dtype=dtype, seed=3)
    q, kc, vc, tables, _, _, scale, *_ = whole.attention_args()
    expected = paged_attention(*whole.attention_args()[:7])
    # The same context in chunks, each after the rows cached before it.
    for start, end in ((93, 150), (85, 93), (84, 85), (0, 5)):
        got = paged_attention(q[start:end], kc, vc, tables,
                              torch.tensor([0, end - start], dtype=torch.int32),
                              torch.tensor([end], dtype=torch.int32), scale)
        assert torch.equal(got, expected[start:end]), (start, end)
    # Every row as a decode row of its own sequence (one query row each).
    rows = paged_attention(q, kc, vc, tables.expand(seq_len, -1).contiguous(),
                           torch.arange(seq_len + 1, dtype=torch.int32),
                           torch.arange(1, seq_len + 1, dtype=torch.int32), scale)
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2 ** -8)])
def test_threads_do_not_change_the_bits_and_padding_rows_are_zero(dtype, tolerance):
    batch = make_paged_batch([700, 1, 300, 45], [700, 1, 120, 1], 9, 3, 64, 16, dtype=dtype,
                             seed=5)
    q, kc, vc, tables, starts, lens, scale, *_ = batch.attention_args()
    padded = torch.cat([q, torch.randn(3, *q.shape[1:]).to(dtype)])
    results = []
    for threads in (1, 2):
        with torch_threads(threads):
            results.append(paged_attention(padded, kc, vc, tables, starts, lens, scale))
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0][-3:], torch.zeros(3, *q.shape[1:], dtype=dtype))
    torch.testing.assert_close(results[0][:-3].float(), dense_attention(batch),
                               atol=2e-5 if dtype == torch.float32 else 1e-4, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_runs_prefill_steps_here_and_batch_invariant_mode_elsewhere(monkeypatch,
                                                                           dtype):
    batch = make_paged_batch(SEQ_LENS, QUERY_LENS, 9, 3, 64, 16, dtype=dtype, seed=4)
    # Where the AMX prefill kernel is built it takes bf16 chunks from 16 x 64 positions
    # (test_prefill_attention_amx.py); the tiles' own limit there is 64 x 64.
    monkeypatch.setattr(attention_dispatch, "BF16_AMX_PREFILL_MIN_WORK",
                        attention_dispatch.BF16_AMX_TILE_MAX_WORK)
    calls = []

    def tiles(*args):
        calls.append(args[0].dtype)
        return paged_attention(*args)
    monkeypatch.setattr(cpu_attention, "paged_attention", tiles)
    out = dispatch.paged_attention(*batch.attention_args())
    assert calls == [dtype]
    assert torch.equal(out, paged_attention(*batch.attention_args()[:7]))
    dispatch.paged_attention(*batch.attention_args(), batch_invariant=True)
    assert calls == [dtype]


def test_declines_what_it_does_not_handle():
    batch = make_paged_batch([20, 9], [20, 1], 4, 2, 36, 16, seed=2)  # head_dim % 8 != 0
    assert _run(batch) is None
    bf16 = make_paged_batch([20, 9], [20, 1], 4, 2, 64, 16, dtype=torch.bfloat16, seed=2)
    assert _run(bf16) is None  # the float32 entry point; paged_attention takes bf16
    half = make_paged_batch([20, 9], [20, 1], 4, 2, 64, 16, dtype=torch.float16, seed=2)
    assert paged_attention(*half.attention_args()[:7]) is None
    mixed = make_paged_batch([20, 9], [20, 1], 4, 2, 64, 16, seed=2)
    q, kc, vc, *rest = mixed.attention_args()[:7]
    assert paged_attention(q.to(torch.bfloat16), kc, vc, *rest) is None
    # seq_lens shorter than the chunk: declined here, and dispatch names the field.
    bad = make_paged_batch([20, 9], [20, 1], 4, 2, 64, 16, seed=2)
    bad.seq_lens[0] = 10
    assert _run(bad) is None
    with pytest.raises(ValueError, match="seq_lens"):
        dispatch.paged_attention(*bad.attention_args()[:-1], 20)


def test_dispatch_sends_chunks_past_the_tile_limit_to_sdpa(monkeypatch):
    # bf16 on an AMX host cuts over at a few thousand query x context positions; there the
    # chunks go to the AMX prefill kernel (test_prefill_attention_amx.py), SDPA where it
    # declines, as here.
    batch = make_paged_batch([300, 9], [300, 1], 9, 3, 64, 16, dtype=torch.bfloat16, seed=6)
    monkeypatch.setattr(attention_dispatch, "_tile_max_work", lambda dtype: 1000)
    monkeypatch.setattr(attention_dispatch, "_cpu_prefill", lambda dtype: None)
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *args: pytest.fail("tiles"))
    sdpa = []
    prefill = torch_ops.prefill_attention
    monkeypatch.setattr(torch_ops, "prefill_attention",
                        lambda *args: sdpa.append(1) or prefill(*args))
    out = dispatch.paged_attention(*batch.attention_args())
    assert sdpa == [1]
    torch.testing.assert_close(out.float(), dense_attention(batch), atol=2e-2, rtol=2e-2)
