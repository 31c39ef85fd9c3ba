"""The AMX prefill attention kernel (kernels/cpu/prefill_attention_amx.c) against the dense
float32 reference, the properties its blocking is built for (a row's bits depend on its
position and context alone, not on its chunk, its tile or the thread count; stale cache
slots never reach a result), what it declines, and dispatch sending bf16 chunks to it
exactly on AMX hosts. The kernel tests run wherever the library is built for AMX and skip
with the reason elsewhere; the routing and build tests run everywhere."""
import pytest
import torch

from kernels import dispatch, torch_ops
from kernels.cpu import features as cpu_features
from kernels.cpu import native as cpu_native
from kernels.cpu import paged_attention as cpu_attention
from testing.paged_batch import dense_attention, make_paged_batch
from testing.threads import torch_threads

needs_amx = pytest.mark.skipif(
    not cpu_attention.prefill_amx_built(),
    reason="needs the native library built for AMX (an uncapped CPU with amx_tile, "
           "amx_bf16 and avx512_bf16)")


def _chunks(batch):
    starts = batch.query_start_loc
    return starts[:-1], starts[1:] - starts[:-1]


def _run(batch, out=None):
    out = torch.zeros_like(batch.query) if out is None else out
    starts, lens = _chunks(batch)
    ok = cpu_attention.prefill_attention_amx(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, starts, lens,
        batch.seq_lens, batch.scale, out)
    return out if ok else None


# Fresh prompts, chunks after cached context (ending inside and on 64-key blocks), decode
# rows (chunks of one), a sequence without rows and a context past 512 keys.
SEQ_LENS = [7, 40, 33, 64, 1, 90, 12, 5, 300, 700]
QUERY_LENS = [1, 40, 17, 31, 1, 1, 5, 0, 300, 65]

# GQA groups of 3 (SmolLM2), 4 (Llama-3.2-1B), 8 and a whole tile of 16, MHA; head_dim
# 64, 128 and 256; block sizes 16 and 32.
SHAPES = pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (32, 8, 64, 16), (8, 1, 128, 32), (32, 2, 128, 16), (4, 4, 64, 16),
    (6, 2, 256, 16)])


@needs_amx
@SHAPES
def test_matches_dense_attention(num_heads, num_kv_heads, head_dim, block_size):
    batch = make_paged_batch(SEQ_LENS, QUERY_LENS, num_heads, num_kv_heads, head_dim,
                             block_size, dtype=torch.bfloat16, seed=head_dim + num_heads)
    out = _run(batch)
    assert out is not None
    want = dense_attention(batch)
    # bf16 inputs, P rounded to bf16 for the tile product, the output rounded to bf16.
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    # Within that: as close as torch's own bf16 SDPA path (each chunk through SDPA).
    sdpa = torch_ops.paged_attention(*batch.attention_args())
    ours = (out.float() - want).abs().mean()
    theirs = (sdpa.float() - want).abs().mean()
    assert ours <= 1.5 * theirs, (ours, theirs)


@needs_amx
def test_a_rows_bits_depend_on_its_position_alone():
    # One 200-token prompt's K/V; its rows as one chunk, as three chunks of a prefill
    # split across steps (each seeing the context so far), at 1 and 2 threads.
    whole = make_paged_batch([200], [200], 9, 3, 64, 16, dtype=torch.bfloat16, seed=11)
    with torch_threads(2):
        want = _run(whole)
    cuts = [(0, 70), (70, 150), (150, 200)]
    for threads in (1, 2):
        for start, end in cuts:
            piece = make_paged_batch([end], [end - start], 9, 3, 64, 16,
                                     dtype=torch.bfloat16, seed=11)
            # Same cache and tables; only the query rows and their positions differ.
            piece.key_cache, piece.value_cache = whole.key_cache, whole.value_cache
            piece.block_tables = whole.block_tables
            piece.query = whole.query[start:end].contiguous()
            with torch_threads(threads):
                got = _run(piece)
            assert torch.equal(got, want[start:end]), (threads, start, end)


@needs_amx
def test_stale_cache_slots_never_reach_a_result():
    # Slots no sequence owns, in its last block and elsewhere, hold NaN: a score past the
    # context is masked and its V row is never multiplied (0 x NaN would be NaN).
    batch = make_paged_batch([37, 300], [37, 45], 9, 3, 64, 16, dtype=torch.bfloat16, seed=5)
    want = _run(batch)
    owned = torch.zeros(batch.key_cache.shape[0] * 16, dtype=torch.bool)
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        ids = batch.block_tables[seq, :-(-seq_len // 16)].long()
        owned[(ids[:, None] * 16 + torch.arange(16)).reshape(-1)[:seq_len]] = True
    for cache in (batch.key_cache, batch.value_cache):
        cache.view(-1, 3, 64)[~owned] = float("nan")
    got = _run(batch)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)


@needs_amx
def test_rows_outside_the_chunks_are_left_alone():
    batch = make_paged_batch([20, 50], [20, 10], 9, 3, 64, 16, dtype=torch.bfloat16, seed=3)
    out = torch.full_like(batch.query, 7.0)
    starts, lens = _chunks(batch)
    # Only the second chunk is given.
    assert cpu_attention.prefill_attention_amx(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables[1:], starts[1:],
        lens[1:], batch.seq_lens[1:], batch.scale, out)
    assert (out[:20] == 7.0).all()
    torch.testing.assert_close(out[20:].float(), dense_attention(batch)[20:], atol=2e-2,
                               rtol=2e-2)


@needs_amx
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,why", [
    (4, 2, 96, 16, torch.bfloat16, "head_dim not a multiple of 64"),
    (32, 1, 64, 16, torch.bfloat16, "a group of 32 heads"),
    (9, 3, 64, 8, torch.bfloat16, "block_size not a multiple of 16"),
    (9, 3, 64, 16, torch.float32, "float32"),
])
def test_declines_what_it_does_not_handle(num_heads, num_kv_heads, head_dim, block_size,
                                           dtype, why):
    batch = make_paged_batch([40, 9], [40, 9], num_heads, num_kv_heads, head_dim,
                             block_size, dtype=dtype, seed=2)
    out = torch.full_like(batch.query, 3.0)
    assert _run(batch, out) is None, why
    assert (out == 3.0).all()  # untouched: dispatch then runs SDPA into it


@needs_amx
def test_declines_lengths_it_cannot_address():
    batch = make_paged_batch([40], [40], 9, 3, 64, 16, dtype=torch.bfloat16, seed=2)
    batch.seq_lens[0] = 30  # shorter than its own chunk
    assert _run(batch) is None
    batch.seq_lens[0] = 4000  # past what its block table row addresses
    assert _run(batch) is None


def test_dispatch_sends_bf16_chunks_to_it_exactly_on_amx_hosts(monkeypatch):
    batch = make_paged_batch([300, 9, 120], [300, 1, 40], 9, 3, 64, 16,
                             dtype=torch.bfloat16, seed=6)
    amx = []
    kernel = cpu_attention.prefill_attention_amx
    monkeypatch.setattr(cpu_attention, "prefill_attention_amx",
                        lambda *args: amx.append(args[4].tolist()) or kernel(*args))
    sdpa = []
    prefill = torch_ops.prefill_attention
    monkeypatch.setattr(torch_ops, "prefill_attention",
                        lambda *args: sdpa.append(1) or prefill(*args))
    out = dispatch.paged_attention(*batch.attention_args())
    torch.testing.assert_close(out.float(), dense_attention(batch), atol=2e-2, rtol=2e-2)
    on_amx = cpu_features.detect().isa == "amx"
    # Both chunks in one call (the decode row goes to the decode kernel) ...
    assert amx == ([[0, 301]] if on_amx else [])
    # ... and on AMX hosts SDPA only where that kernel is not built to take them (other
    # hosts run chunks of this size on the native tile kernel).
    if on_amx:
        assert len(sdpa) == (0 if cpu_attention.prefill_amx_built() else 2)
    # float32 chunks never go to it.
    amx.clear()
    dispatch.paged_attention(*make_paged_batch([300], [300], 9, 3, 64, 16, seed=6)
                             .attention_args())
    assert amx == []


def test_the_build_carries_the_kernel_exactly_where_the_cpu_has_amx():
    if cpu_native.load_library() is None:
        pytest.skip("no native library (no C compiler)")
    assert cpu_attention.prefill_amx_built() == (cpu_features.detect().isa == "amx")
