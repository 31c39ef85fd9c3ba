"""engine.worker.host_memory.zeros: a drop-in for torch.zeros that asks for huge pages."""
import torch

from engine.worker import host_memory


def test_large_buffer_is_zeroed_aligned_and_writable():
    shape = (700, 16, 3, 64)  # 4.3 MB of bf16: two whole huge pages and a tail
    t = host_memory.zeros(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert not bool(t.any())
    t[-1, -1, -1, -1] = 3.0  # the tail past the last whole huge page belongs to it too
    t[0, 0, 0, 0] = 2.0
    assert float(t.float().sum()) == 5.0


def test_small_buffers_and_other_dtypes_match_torch_zeros():
    for shape, dtype in [((5,), torch.float32), ((3, 4), torch.int64), ((2, 1 << 20), torch.float16)]:
        t = host_memory.zeros(shape, dtype)
        assert torch.equal(t, torch.zeros(shape, dtype=dtype))
