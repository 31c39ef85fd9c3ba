"""The C decode-attention kernel (CPU fast path) against the torch implementation."""
import shutil

import pytest
import torch

from kernels import cpu_native, reference
from kernels.testing import make_paged_batch

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
    expected = reference.decode_attention(q, kc, vc, tables, lens, scale)
    got = cpu_native.decode_attention(q, kc, vc, tables, lens, scale)
    assert got is not None and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_long_context_and_thread_split_match():
    batch = make_paged_batch([3000, 1, 700, 1500], [1] * 4, 9, 3, 64, 16, dtype=torch.float32, seed=1)
    q, kc, vc, tables, _, lens, scale, *_ = batch.attention_args()
    expected = reference.decode_attention(q, kc, vc, tables, lens, scale)
    for threads in (1, 3):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = cpu_native.decode_attention(q, kc, vc, tables, lens, scale)
        finally:
            torch.set_num_threads(prev)
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
