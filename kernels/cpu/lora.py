"""The native segmented LoRA update (kernels/cpu/lora_sgmv.c), loaded with the other C
kernels (cpu_native). `lora_add` returns False where it does not apply (no library,
dtype, layout); kernels.dispatch then runs the torch path (kernels/lora_ops.py)."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import features as cpu_features
from kernels.cpu import native as cpu_native
from kernels.lora_ops import SPAN_COLUMNS, LoRASegments, SegmentWeights

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind({"lora_sgmv": (_I32, [_I32, _P, _I64, _P, _I64, _P, _P, _I32, _P,
                                                 _P, _P, _P, _P, _P, _I64, _I64, _I32])})


# Lanes of the packed weights' padding: one AVX-512 vector of float32 sums.
PAIR_LANES = 16


def runs_pairs() -> bool:
    """Whether this host's build runs bf16 updates as dot products of bf16 pairs: AVX512_BF16
    (kernels/cpu/lora_sgmv.c; a capped ISA drops it from the build too)."""
    return _library() is not None and cpu_features.detect().isa in ("avx512_bf16", "amx")


def pack_pairs(m: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [ceil(K / 2), N padded to PAIR_LANES, 2], zero-padded: rows 2p and 2p + 1 of
    m side by side in one 32-bit lane, the operand layout of AVX512_BF16's dot product."""
    k, n = m.shape
    padded = torch.zeros(-(-k // 2) * 2, _lanes(n), dtype=m.dtype)
    padded[:k, :n] = m
    return padded.view(-1, 2, padded.shape[1]).transpose(1, 2).contiguous()


def pairs_of(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rank, in] and B [out, rank] packed as lora_sgmv's at_pairs and bt_pairs read them."""
    return pack_pairs(a.t()), pack_pairs(b.t())


def lora_add(x: torch.Tensor, y: torch.Tensor, segments: LoRASegments,
             weights: SegmentWeights) -> bool:
    """y[rows of g] += (x[rows of g] A_g^T) B_g^T in place; False if not applicable."""
    lib = _library()
    dtype = x.dtype
    if (lib is None or dtype not in _DTYPES or y.dtype != dtype or x.dim() != 2 or y.dim() != 2
            or not x.is_cpu or x.stride(1) != 1 or y.stride(1) != 1
            or not segments.rows.is_cpu):
        return False
    n = segments.num_segments
    a_ptrs, b_ptrs = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
    span_ptrs, a_pair_ptrs, b_pair_ptrs = ((ctypes.c_void_p * n)() for _ in range(3))
    ranks = (ctypes.c_int32 * n)()
    in_features, out_features = x.shape[1], y.shape[1]
    blocks = -(-out_features // SPAN_COLUMNS)
    for g, w in enumerate(weights):
        if w is None:
            continue
        a, b, spans = w.a, w.b, w.rank_spans
        rank = a.shape[0]
        if (a.shape[1] != in_features or b.shape != (out_features, rank)
                or a.dtype != dtype or b.dtype != dtype
                or not w.in_kernel_layout()
                or spans.dtype != torch.int32 or spans.shape != (blocks, 2)
                or not spans.is_contiguous()):
            return False
        a_ptrs[g], b_ptrs[g], span_ptrs[g], ranks[g] = (a.data_ptr(), b.data_ptr(),
                                                        spans.data_ptr(), rank)
        if w.pairs is not None and _pairs_fit(w.pairs, rank, in_features, out_features):
            a_pair_ptrs[g], b_pair_ptrs[g] = w.pairs[0].data_ptr(), w.pairs[1].data_ptr()
    status = lib.lora_sgmv(int(dtype == torch.bfloat16), x.data_ptr(), x.stride(0),
                           y.data_ptr(), y.stride(0), segments.rows.data_ptr(),
                           segments.starts.data_ptr(), n, a_ptrs, b_ptrs, span_ptrs,
                           a_pair_ptrs, b_pair_ptrs, ranks,
                           in_features, out_features, torch.get_num_threads())
    return status == 0


def _pairs_fit(pairs: tuple[torch.Tensor, torch.Tensor], rank: int, in_features: int,
               out_features: int) -> bool:
    a_pairs, b_pairs = pairs
    return (a_pairs.dtype == b_pairs.dtype == torch.bfloat16
            and a_pairs.shape == (-(-in_features // 2), _lanes(rank), 2)
            and b_pairs.shape == (-(-rank // 2), _lanes(out_features), 2)
            and a_pairs.is_contiguous() and b_pairs.is_contiguous())


def _lanes(n: int) -> int:
    """n padded to whole vectors of PAIR_LANES."""
    return -(-n // PAIR_LANES) * PAIR_LANES
