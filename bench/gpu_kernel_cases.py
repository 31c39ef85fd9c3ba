"""Kernel correctness cases: every Triton kernel against fp32 attention over the unpaged K/V.

The expected output is computed on the host (testing.paged_batch.dense_attention), so a
device-side torch bug cannot hide a kernel bug. Each attention case runs with the default
tiles and with small ones, so tiles span pages and contexts span split-K partitions.
Shapes shrink in the rehearsal, where the Triton interpreter runs ~5 ms per program step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bench.gpu_report import Case, Outcome
from testing.paged_batch import dense_attention, make_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}
ArgsTransform = Callable[[list], list]


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...] | None = None  # None: a decode batch (one token each)

    def batch(self, seed: int):
        query_lens = self.query_lens or (1,) * len(self.seq_lens)
        return make_paged_batch(list(self.seq_lens), list(query_lens), self.num_heads,
                                self.num_kv_heads, self.head_dim, self.block_size,
                                dtype=self.dtype, seed=seed)


def on_device(args, device: str) -> list:
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def compare(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """(within tolerance everywhere, max |error|) of a kernel output against fp32 truth."""
    err = (out.float().cpu() - expected).abs()
    tol = TOLERANCE[dtype]
    good = bool(torch.isfinite(err).all()) and bool((err <= tol + tol * expected.abs()).all())
    return good, err.max().item() if err.numel() else 0.0


def check_shapes(shapes: list[AttentionShape], device: str, tiles_list: list,
                 transform: ArgsTransform | None = None) -> Outcome:
    from kernels.triton import ops as triton_ops
    good, worst = True, 0.0
    for seed, shape in enumerate(shapes):
        batch = shape.batch(seed)
        expected = dense_attention(batch)
        args = on_device(batch.attention_args(), device)
        if transform is not None:
            args = transform(args)
        for tiles in tiles_list:
            ok, err = compare(triton_ops.paged_attention(*args, tiles=tiles), expected, shape.dtype)
            good, worst = good and ok, max(worst, err)
    dtypes = sorted({str(s.dtype).removeprefix("torch.") for s in shapes})
    tol = ", ".join(f"{TOLERANCE[getattr(torch, d)]:.0e}" for d in dtypes)
    return Outcome("PASS" if good else "FAIL", f"max|err| {worst:.1e} (tol {tol}), "
                   f"{len(shapes) * len(tiles_list)} launches")


def attention_cases(rehearse: bool) -> dict[str, list[AttentionShape]]:
    """name -> shapes; the last three are risky (gpu_risky_cases runs them last)."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    S = AttentionShape
    if rehearse:
        return {
            "decode bf16 9/3 D64 bs16": [S(9, 3, 64, 16, bf16, (1, 17, 70))],
            "decode bf16 32/8 D128 bs16": [S(32, 8, 128, 16, bf16, (5, 40))],
            "decode fp16 16/2 D128 bs32": [S(16, 2, 128, 32, fp16, (9, 33))],
            "prefill bf16 9/3 D64 mixed": [S(9, 3, 64, 16, bf16, (30, 40, 7, 12, 1),
                                             (30, 11, 1, 0, 1))],
            "prefill bf16 32/8 D128 bs32": [S(32, 8, 128, 32, bf16, (24, 20), (24, 5))],
            "prefill fp16 16/2 D128 bs16": [S(16, 2, 128, 16, fp16, (20, 5), (12, 5))],
            "head_dim 8 bf16 decode+prefill": [S(4, 2, 8, 16, bf16, (1, 20)),
                                               S(4, 2, 8, 16, bf16, (20, 9), (12, 1))],
            "fp32 D64 decode+prefill": [S(8, 8, 64, 8, fp32, (1, 33)),
                                        S(8, 1, 64, 8, fp32, (29, 3), (20, 3))],
            "fp32 D128 decode+prefill": [S(32, 8, 128, 16, fp32, (5, 40)),
                                         S(16, 2, 128, 16, fp32, (24, 5), (12, 5))],
            "int64 block tables": [S(9, 3, 64, 16, bf16, (1, 17, 40)),
                                   S(9, 3, 64, 16, bf16, (20, 9), (12, 1))],
        }
    return {
        "decode bf16 9/3 D64 bs16": [S(9, 3, 64, 16, bf16, (1, 17, 512, 2049, 3000))],
        "decode bf16 32/8 D128 bs16": [S(32, 8, 128, 16, bf16, (5, 700, 2500))],
        "decode fp16 16/2 D128 bs32": [S(16, 2, 128, 32, fp16, (9, 1024, 1025))],
        "prefill bf16 9/3 D64 mixed": [S(9, 3, 64, 16, bf16, (300, 1200, 7, 64, 1),
                                         (300, 77, 1, 0, 1))],
        "prefill bf16 32/8 D128 bs32": [S(32, 8, 128, 32, bf16, (2000, 513), (2000, 13))],
        "prefill fp16 16/2 D128 bs16": [S(16, 2, 128, 16, fp16, (1000, 5), (250, 5))],
        "head_dim 8 bf16 decode+prefill": [S(4, 2, 8, 16, bf16, (1, 40, 300)),
                                           S(4, 2, 8, 16, bf16, (64, 9), (64, 1))],
        # fp32 tiles of 64 x 128 at several pipeline stages may not fit in shared memory.
        "fp32 D64 decode+prefill": [S(8, 8, 64, 8, fp32, (1, 33, 1500)),
                                    S(8, 1, 64, 8, fp32, (129, 40, 3), (100, 1, 3))],
        "fp32 D128 decode+prefill": [S(32, 8, 128, 16, fp32, (5, 700, 2500)),
                                     S(16, 2, 128, 16, fp32, (1000, 5), (250, 5))],
        "int64 block tables": [S(9, 3, 64, 16, bf16, (1, 17, 512, 2049)),
                               S(9, 3, 64, 16, bf16, (300, 64, 1), (300, 5, 1))],
    }


def int64_indices(args: list) -> list:
    # block_tables, query_start_loc, seq_lens: the runner may hand any of them as int64
    return args[:3] + [t.to(torch.int64) for t in args[3:6]] + args[6:]


def tiles_for(rehearse: bool) -> list:
    from kernels.triton import ops as triton_ops
    small = triton_ops.AttentionTiles(block_n=16, block_m=16,
                                      partition_size=32 if rehearse else 64)
    return [triton_ops.DEFAULT_TILES, small]


def check_reshape_and_cache(device: str, rehearse: bool) -> Outcome:
    from kernels import torch_ops
    from kernels.triton import ops as triton_ops
    blocks, block_size, kv_heads, dim, tokens = (8, 8, 2, 32, 20) if rehearse else (64, 16, 8,
                                                                                      128, 300)
    gen = torch.Generator().manual_seed(7)
    checked = []
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
        # K and V as strided views of one fused projection output, as the model hands them
        fused = torch.randn(tokens, 3 * kv_heads, dim, generator=gen).to(dtype)
        key, value = fused[:, :kv_heads], fused[:, kv_heads:2 * kv_heads]
        slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
        slots[::7] = -1
        want_k, want_v = cache.clone(), cache.clone()
        torch_ops.reshape_and_cache(key, value, want_k, want_v, slots)
        got_k, got_v = cache.to(device, copy=True), cache.to(device, copy=True)
        triton_ops.reshape_and_cache(key.to(device), value.to(device), got_k, got_v,
                                     slots.to(device))
        if not (torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)):
            return Outcome("FAIL", f"{dtype}: cache differs from the torch reference")
        checked.append(str(dtype).removeprefix("torch."))
    return Outcome("PASS", f"{'+'.join(checked)}: {tokens} tokens bit-exact, slot -1 skipped")


def check_dispatch(device: str) -> Outcome:
    import kernels
    from kernels.triton import ops as triton_ops
    batch = make_paged_batch([20, 9], [4, 1], 6, 2, 64, 16)
    args = on_device(batch.attention_args(), device)
    via_dispatch, direct = kernels.paged_attention(*args), triton_ops.paged_attention(*args)
    if device.startswith("cuda"):
        same = torch.equal(via_dispatch, direct)
        return Outcome("PASS" if same else "FAIL", "kernels.paged_attention == triton_ops on "
                       f"{device}" if same else "dispatch output differs from the Triton path")
    good, err = compare(via_dispatch, direct.float().cpu(), torch.float32)
    return Outcome("PASS" if good else "FAIL", f"CPU tensors take the C/torch path by design; "
                   f"agrees with Triton to {err:.1e}")


def safe_cases(device: str, rehearse: bool) -> list[Case]:
    shapes, tiles = attention_cases(rehearse), tiles_for(rehearse)
    cases = [Case(name, lambda s=s: check_shapes(s, device, tiles))
             for name, s in list(shapes.items())[:-3]]
    cases.append(Case("dispatch picks Triton on the device", lambda: check_dispatch(device)))
    cases.append(Case("reshape_and_cache bf16+fp32",
                      lambda: check_reshape_and_cache(device, rehearse)))
    return cases
