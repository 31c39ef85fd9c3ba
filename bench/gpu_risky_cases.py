"""The cases most likely to fault or fail to compile, which the plan runs last: fp32 tiles
(shared memory), int64 index tensors, a KV cache past 2^31 elements (int64 offsets) and a
second GPU (Triton launches on the current device unless told otherwise).
"""
from __future__ import annotations

import torch

from bench.gpu_kernel_cases import (AttentionShape, attention_cases, check_shapes, compare,
                                    int64_indices, on_device, tiles_for)
from bench.gpu_report import Case, Outcome
from testing.paged_batch import dense_attention

INT32_LIMIT = 2 ** 31


def enforce_gpu_dot_shapes() -> str:
    """Make the interpreter refuse tl.dot shapes a GPU refuses.

    The interpreter accepts any shape (min_dot_size (1, 1, 1)); Triton's NVIDIA backend
    needs K >= 16 for 16-bit operands (3.6; 3.9 lowers it to 8 for fp32). The kernels cast
    every operand to fp32 under the interpreter (FP32_DOT), which would hide the 16-bit
    limit, so K >= 16 is enforced for all dtypes."""
    try:
        from triton.runtime import interpreter
        interpreter.interpreter_builder.codegen_fns["min_dot_size"] = lambda lhs, rhs: (1, 1, 16)
    except (ImportError, AttributeError) as error:
        return f"could not make the interpreter enforce the GPU's tl.dot shapes ({error})"
    return "the interpreter enforces the GPU's tl.dot minimum (K >= 16)"


def check_huge_kv_cache(device: str, rehearse: bool) -> Outcome:
    if rehearse or not device.startswith("cuda"):
        return Outcome("SKIP", "needs 8 GiB of device memory: GPU run only")
    from kernels.triton import ops as triton_ops
    kv_heads, head_dim, block_size, dtype = 8, 128, 16, torch.bfloat16
    per_block = block_size * kv_heads * head_dim
    base = INT32_LIMIT // per_block  # first block whose elements all lie past 2^31
    shapes = [AttentionShape(16, kv_heads, head_dim, block_size, dtype, (37, 1000, 3)),
              AttentionShape(16, kv_heads, head_dim, block_size, dtype, (37, 200, 3), (37, 50, 1))]
    batches = [s.batch(seed) for seed, s in enumerate(shapes)]
    total_blocks = base + max(b.key_cache.shape[0] for b in batches)
    needed = 2 * total_blocks * per_block * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    if free < needed + 2 * 1024 ** 3:
        return Outcome("SKIP", f"{free / 2**30:.0f} GiB free, {needed / 2**30:.0f} GiB needed")
    key_cache = torch.empty(total_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                            device=device)
    value_cache = torch.empty_like(key_cache)
    good, worst = True, 0.0
    for batch in batches:
        used = batch.key_cache.shape[0]
        key_cache[base:base + used] = batch.key_cache.to(device)
        value_cache[base:base + used] = batch.value_cache.to(device)
        args = on_device(batch.attention_args(), device)
        # every block, the padding entries included, now lives past element 2^31
        args[1:4] = [key_cache, value_cache, args[3] + base]
        ok, err = compare(triton_ops.paged_attention(*args), dense_attention(batch), dtype)
        good, worst = good and ok, max(worst, err)
    key = torch.randn(5, kv_heads, head_dim, device=device).to(dtype)
    slots = (total_blocks - 1) * block_size + torch.arange(5, device=device)
    triton_ops.reshape_and_cache(key, key, key_cache, value_cache, slots)
    written = torch.equal(key_cache[-1, :5], key) and torch.equal(value_cache[-1, :5], key)
    del key_cache, value_cache
    torch.cuda.empty_cache()
    elements = total_blocks * per_block
    return Outcome("PASS" if good and written else "FAIL",
                   f"{elements / 2**31:.3f} x 2^31 elements: attention max|err| {worst:.1e}, "
                   f"top-slot write {'exact' if written else 'WRONG'}")


def check_second_device(rehearse: bool) -> Outcome:
    count = 0 if rehearse else torch.cuda.device_count()
    if count < 2:
        return Outcome("SKIP", f"{count} GPU{'s' if count != 1 else ''}: needs two")
    import kernels
    target = "cuda:1"
    # The current device stays cuda:0: tensors on cuda:1 must still run there.
    shape = AttentionShape(9, 3, 64, 16, torch.bfloat16, (17, 300, 1), (5, 1, 1))
    batch = shape.batch(seed=3)
    out = kernels.paged_attention(*on_device(batch.attention_args(), target))
    torch.cuda.synchronize(target)
    good, err = compare(out, dense_attention(batch), shape.dtype)
    key_cache = torch.zeros(4, 16, 3, 64, device=target)
    key = torch.randn(3, 3, 64, device=target)
    kernels.reshape_and_cache(key, key, key_cache, key_cache.clone(),
                              torch.tensor([0, 17, 63], device=target))
    torch.cuda.synchronize(target)
    written = torch.equal(key_cache.view(-1, 3, 64)[[0, 17, 63]], key)
    return Outcome("PASS" if good and written else "FAIL",
                   f"current device {torch.cuda.current_device()}, tensors on {target}: "
                   f"max|err| {err:.1e}, cache write {'exact' if written else 'WRONG'}")


def risky_cases(device: str, rehearse: bool) -> list[Case]:
    shapes, tiles = attention_cases(rehearse), tiles_for(rehearse)
    names = list(shapes)[-3:]  # fp32 D64, fp32 D128, int64 block tables
    cases = [Case(name, lambda name=name: check_shapes(
        shapes[name], device, tiles, int64_indices if "int64" in name else None))
        for name in names]
    cases.append(Case("KV cache >= 2^31 elements", lambda: check_huge_kv_cache(device, rehearse)))
    cases.append(Case("device cuda:1", lambda: check_second_device(rehearse)))
    return cases
