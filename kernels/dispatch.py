"""The one place that picks a kernel: the engine calls these and nothing else in kernels/.

Each op goes, by the device of its tensors:
  CUDA -> the Triton kernel where one exists (paged attention, KV writes), else torch;
  CPU  -> the native C kernel (cpu_native) when it handles the dtype and layout, else torch.
The torch versions (kernels/torch_ops.py) define every op's semantics. Adding a device or
an ISA-specific kernel means one more branch here; the callers do not change.

The model's matmuls come here too: `prepare_linear` turns a loaded weight (dense, or GGUF
blocks) into a LinearWeight once (prepacked for oneDNN where that is faster), and
`linear` picks by its kind and the row count: GGUF native or dense GEMM, the native
few-row kernel, the native float32 GEMM (AVX2 hosts), the native bf16 GEMM (AVX-512 BF16
and AMX hosts, on tiles where AMX runs), oneDNN's prepacked GEMM, or F.linear.

Batch-invariant mode (the engine's batch_invariant) takes the row count out of every
choice: float32 matmuls run the native GEMM for any number of rows, one included, wherever
it builds (each output is one FMA chain over `in` in order, whatever rows share its tile;
threads split the columns, never the sum), bf16 ones the native row kernel (a fixed 8-wide
order), GGUF weights the int8 kernel's one-row arithmetic (the VNNI panel kernel is
row-invariant as it is), LoRA updates the native kernel's row-by-row sums, and attention
runs every query token as a decode row (keys in block_size blocks in position order), so a
token's values depend on its own row alone. Norms already run per row.
kernels/torch_invariant.py covers what the native kernels decline.

These run ~100 times per decode step, so each does one device test and one call: no
allocation or feature detection of its own (cpu_native caches its library load). The
Triton module is imported only for CUDA tensors, so CPU deployments never need triton.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F

from kernels.cpu import decode_step as cpu_decode_step
from kernels.cpu import features as cpu_features
from kernels.cpu import gemm as cpu_gemm
from kernels.cpu import linear as cpu_linear
from kernels.cpu import lora as cpu_lora
from kernels.cpu import native as cpu_native
from kernels.cpu import onednn as cpu_onednn
from kernels.cpu import paged_attention as cpu_attention
from kernels import lora_ops, torch_invariant, torch_ops
from kernels.cpu.decode_step import DecodeStepPlan, LayerWeights
from kernels.cpu.gguf_weight import GgufWeight
from kernels.linear_weight import LinearWeight
# The engine builds a step's segments and lays adapters out through these re-exports.
from kernels.lora_ops import LoRASegments, LoRAWeights, SegmentWeights, make_segments  # noqa: F401
from kernels.validation import check_paged_attention, check_reshape_and_cache


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V at its slot (block_id * block_size + offset); -1 skips."""
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if key_cache.is_cuda:
        from kernels.triton import ops as triton_ops
        triton_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    elif not cpu_native.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
        torch_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, batch_invariant: bool = False) -> torch.Tensor:
    """Causal attention of every sequence's query chunk over its paged K/V -> [T, H, D].
    `batch_invariant`: every token as a decode row (CPU; the engine refuses it on CUDA)."""
    check_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                          seq_lens, scale, max_query_len, max_seq_len)
    if batch_invariant:
        return torch_ops.paged_attention(query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, scale, max_query_len,
                                         max_seq_len, decode=_invariant_decode, rows_only=True)
    if query.is_cuda:
        from kernels.triton import ops as triton_ops
        return triton_ops.paged_attention(query, key_cache, value_cache, block_tables,
                                          query_start_loc, seq_lens, scale, max_query_len,
                                          max_seq_len)
    max_work = _tile_max_work(query.dtype)
    if query.dtype in _TILE_DTYPES and max_query_len > 1 and _chunks_fit_tiles(
            query_start_loc, seq_lens, max_query_len, max_seq_len, max_work):
        # Prefill chunks and the step's decode rows in one native call, in tiles of rows.
        out = cpu_attention.paged_attention(query, key_cache, value_cache, block_tables,
                                            query_start_loc, seq_lens, scale)
        if out is not None:
            return out
    return torch_ops.paged_attention(query, key_cache, value_cache, block_tables,
                                     query_start_loc, seq_lens, scale, max_query_len,
                                     max_seq_len, decode=_cpu_decode, rows_max_work=max_work,
                                     prefill=_cpu_prefill(query.dtype))


# The tile kernel's dtypes (bf16 computes in float32 there, as the decode kernel does).
_TILE_DTYPES = (torch.float32, torch.bfloat16)
# With AMX, torch's bf16 SDPA (oneDNN brgemm on the tiles) beats the tile kernel's float32
# arithmetic from small chunks on (tiles vs SDPA): 0.10 vs 0.11 ms at 64 x 64 positions,
# 0.36 vs 0.31 at 16 rows over 512, 2.5 vs 0.9 at 128 over 512, 5.4 vs 2.4 for a fresh 512
# (the decode kernel's rows, which took such chunks before: 9.1 ms there) (SmolLM2's
# 9/3 heads, one layer; amx host, 1 thread), so bf16 chunks past this much query x
# context work go to SDPA rather than to the tiles or the decode kernel's rows. Capped
# to AVX-512 BF16 on the same host the tiles still won to ~16k (1.3x at 128 x 128, 0.8x
# at 64 over 512) and to 512 x 512 at AVX2, so there bf16 keeps float32's ROWS_MAX_WORK.
BF16_AMX_TILE_MAX_WORK = 64 * 64
# Where the AMX prefill kernel is built, it takes bf16 chunks from less work still: 1.9x
# the tiles at 16 x 64 positions, 1.1x at 8 x 64 (1 thread; SmolLM2's 9/3 heads, and
# 2.0-2.7x at Llama-3.2-1B's 32/8).
BF16_AMX_PREFILL_MIN_WORK = 16 * 64


def _tile_max_work(dtype: torch.dtype) -> int:
    if dtype == torch.bfloat16 and cpu_features.detect().isa == "amx":
        if cpu_attention.prefill_amx_built():
            return BF16_AMX_PREFILL_MIN_WORK
        return BF16_AMX_TILE_MAX_WORK
    return torch_ops.ROWS_MAX_WORK


def _cpu_prefill(dtype: torch.dtype):
    # bf16 chunks on AMX: flash attention on the tiles, 2.5-3x SDPA at 128-512-token
    # prompts and 1.6-1.9x at 2,048 (SmolLM2's 9/3 heads, 1-2 threads, AMX host).
    if dtype == torch.bfloat16 and cpu_features.detect().isa == "amx":
        return cpu_attention.prefill_attention_amx
    return None


def _chunks_fit_tiles(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      max_query_len: int, max_seq_len: int, max_work: int) -> bool:
    # Past ROWS_MAX_WORK a chunk runs faster through SDPA's fused kernel: 156 vs 235 ms
    # for one fresh 2048-token prompt, while the tiles took 61 vs 89 ms (4 x 512 tokens)
    # against the decode kernel's rows (SmolLM2 shapes, 1 thread, AVX2 EPYC).
    if max_query_len * max_seq_len <= max_work:
        return True
    work = (query_start_loc[1:] - query_start_loc[:-1]).long() * seq_lens.long()
    return int(work.max()) <= max_work


def _cpu_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    # The CPU prefill path stays torch (SDPA's fused kernel); only decode rows, and short
    # chunks run as rows (torch_ops.ROWS_MAX_WORK), take the C kernel.
    out = cpu_native.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    if out is None:
        out = torch_ops.decode_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         scale)
    return out


def _invariant_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    # The C kernel is one row's online softmax over its blocks, whatever the batch.
    out = cpu_native.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    if out is None:
        out = torch_invariant.decode_attention(query, key_cache, value_cache, block_tables,
                                               seq_lens, scale)
    return out


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, batch_invariant: bool = False) -> torch.Tensor:
    """residual += x in place (when x is given); returns rms_norm(residual) * weight.
    The C kernels sum each row alone; `batch_invariant` makes the torch path do so too."""
    if not residual.is_cuda:
        out = cpu_native.add_rms_norm(x, residual, weight, eps)
        if out is not None:
            return out
    if batch_invariant:
        return torch_invariant.add_rms_norm(x, residual, weight, eps)
    return torch_ops.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    if not gate_up.is_cuda:
        out = cpu_native.silu_mul(gate_up)
        if out is not None:
            return out
    return torch_ops.silu_mul(gate_up)


def gate_up_silu(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """silu_mul(linear(x, weight)) for the MLP's fused [gate; up] weight -> [tokens, inter].
    bf16 panels on AMX tiles (BF16_TILES_MIN_ROWS rows and up) run both in one pass, the
    same bits without the [tokens, 2 * inter] product in memory (SmolLM2's prefill steps
    spent 48 of 493 ms in silu_mul, reading that product back); the rest runs the two."""
    rows = x.reshape(-1, x.shape[-1])
    if _on_bf16_tiles(weight, rows):
        out = cpu_gemm.gemm_bf16_silu(rows, weight.panels, weight.out_features // 2,
                                      weight.bias)
        if out is not None:
            return out.view(*x.shape[:-1], weight.out_features // 2)
    return silu_mul(linear(x, weight))


def _on_bf16_tiles(weight: LinearWeight, rows: torch.Tensor) -> bool:
    # bf16 panels run on AMX tiles from BF16_TILES_MIN_ROWS rows (one row stays on
    # vdpbf16ps, the fused single-sequence step's bits), for linear and gate_up_silu alike.
    # Batch-invariant bf16 weights never hold panels (prepare_linear), so never get here.
    return (weight.panels is not None and weight.panels.dtype == torch.bfloat16
            and rows.shape[0] >= BF16_TILES_MIN_ROWS and bool(cpu_gemm.bf16_amx_built()))


def rope(qkv: torch.Tensor, num_heads: int, head_dim: int, rot_half: int,
         positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
         cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of the first num_heads heads of each row of a 2-D buffer (rows may
    be longer: the fused qkv layout) -> contiguous [rows, num_heads, head_dim].

    The native kernel gathers from the [max_pos, rot_half] tables by int64 positions;
    the torch path takes the rows already gathered (cos/sin [rows, 1, rot_half]), which
    the model looks up once per forward for all its layers."""
    if not qkv.is_cuda:
        out = cpu_native.rope(qkv, num_heads, head_dim, rot_half, positions, cos_table, sin_table)
        if out is not None:
            return out
    return torch_ops.rope(qkv, num_heads, head_dim, cos, sin)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum, int64 (a bf16 CPU kernel skips torch's upcast)."""
    if not x.is_cuda:
        out = cpu_native.argmax_rows(x)
        if out is not None:
            return out
    return torch_ops.argmax_rows(x)


# The native row kernel streams W once per call and beats oneDNN's blocked GEMM only
# while there is no reuse to block for: 20 vs 25 ms per SmolLM2 fp32 token at M = 1,
# even at M = 2, slower from M = 4 (2-core AVX2 EPYC, DRAM-resident weights).
DENSE_ROWS_MAX = 2


def dense_linear_rows(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T + b by the native row kernel when it is the faster choice (float32 or bf16
    CPU, at most DENSE_ROWS_MAX rows); None otherwise (`linear` goes on to oneDNN or torch)."""
    if x.dim() != 2 or x.shape[0] > DENSE_ROWS_MAX or x.is_cuda:
        return None
    if x.dtype == torch.bfloat16:
        return cpu_linear.linear_bf16_rows(x, weight, bias)
    return cpu_linear.linear_f32_rows(x, weight, bias)


def gguf_kernel_available() -> bool:
    """Whether gguf_linear runs natively; its torch path dequantizes W on every call,
    too slow to serve with, so the loader keeps weights dense without it."""
    return cpu_linear.available()


# From this many rows (long prefill chunks) a GGUF matmul dequantizes W to float32 and
# runs the dense GEMM: compute-bound there, oneDNN/MKL's blocking beats the int8 kernel's
# tiles, and writing W out once (~0.5 ns a weight) is paid back over the rows. Below it
# the int8 kernel wins (1.2x oneDNN at 16 rows, 0.9-1.1x at 64; 2-core AVX2 EPYC).
GGUF_DENSE_MIN_ROWS = 256
# Where the native float32 GEMM is preferred (AVX2), float32 batches from this many rows
# widen W a few rows at a time inside it instead: 1.1-1.2x the int8 kernel at 16 rows,
# 1.3x at 64, 1.5-1.7x at 128, 0.55-0.7x at 8 (SmolLM2's layers, Q4_1 and Q8_0, 1 thread's
# CPU time on a 2-core AVX2 EPYC).
GGUF_PANEL_MIN_ROWS = 16
# Where AMX runs (kernels/cpu/linear_gguf_amx.c), bf16 batches from this many rows widen W
# to bf16 a 32-row block at a time and multiply on tiles instead of any path below: at 8
# rows 1.8-2.5x the int8 kernel (it breaks even at 4-6), 9-11x at 64, 12-17x at 256, and
# 0.6-1.4x a dense bf16 oneDNN matmul throughout; one row 0.3-0.5x (widening W costs the
# same for any row count). SmolLM2-135M's layers, Q4_1 and Q8_0, 1 thread (2 threads
# alike), 2-core Sapphire Rapids (amx), shared host.
GGUF_AMX_MIN_ROWS = 8


def prepare_gguf(weight: GgufWeight) -> GgufWeight:
    """The layout a GGUF weight is served in: VNNI panels where that kernel is built and
    AMX's is not in use (it reads rows; which is faster there was not measured), else the
    file's rows. On a 2-core Zen 4 (AVX-512 VNNI + BF16), SmolLM2's layers at bf16 x, Q4_1
    and Q8_0, the panels ran 1.4-4.7x the row kernel, and 2.3-3.0x oneDNN's dense bf16
    GEMM on the same weights at one row, 1.23-1.55x at 16-256 rows (1.03-1.29x at 512-2048:
    no dense route beside them); Llama-3.2-1B's alike (bench.bench_gguf_kernels). The
    panels replace the rows: the embedding lookup and the torch paths read them too."""
    if (weight.layout == "rows" and cpu_linear.gguf_vnni_built()
            and not cpu_linear.gguf_amx_available()):
        return weight.to_panels()
    return weight


def gguf_linear(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None,
                batch_invariant: bool = False) -> torch.Tensor:
    """x W^T + b for W in GGUF blocks ([tokens, in] -> [tokens, out], x's dtype). The
    native kernel quantizes x to int8 per 32-block (as llama.cpp does); the torch path
    dequantizes W, which is exact but slow (hosts without a C compiler). Panels (VNNI,
    prepare_gguf) run their kernel at every row count; rows go by the row count below.
    `batch_invariant`: every row in the kernel's one-row order, for any row count."""
    if batch_invariant:
        out = cpu_linear.linear_gguf(x, weight, bias, single_row_order=True)
        if out is not None:
            return out
        return torch_invariant.linear(x, weight.dequantize().to(x.dtype), bias)
    if weight.layout == "panels":  # prepare_gguf chose the VNNI kernel for every row count
        out = cpu_linear.linear_gguf(x, weight, bias)
        if out is not None:
            return out
        return F.linear(x, weight.dequantize().to(x.dtype), bias)
    if (x.dim() == 2 and x.shape[0] >= GGUF_AMX_MIN_ROWS and x.dtype == torch.bfloat16
            and cpu_linear.gguf_amx_available()):
        out = cpu_linear.linear_gguf_amx(x, weight, bias)
        if out is not None:
            return out
    if (x.dim() == 2 and x.shape[0] >= GGUF_PANEL_MIN_ROWS and x.dtype == torch.float32
            and cpu_gemm.preferred()):
        out = cpu_gemm.gemm_gguf(x, weight, bias)
        if out is not None:
            return out
    if x.dim() == 2 and x.shape[0] >= GGUF_DENSE_MIN_ROWS:
        dense = cpu_linear.dequantize_rows(weight, None)
        if dense is not None:
            return F.linear(x, dense.to(x.dtype), bias if bias is None else bias.to(x.dtype))
    out = cpu_linear.linear_gguf(x, weight, bias)
    if out is not None:
        return out
    return F.linear(x, weight.dequantize().to(x.dtype), bias)


def prepare_linear(weight: torch.Tensor | GgufWeight, bias: torch.Tensor | None,
                   batch_invariant: bool = False) -> LinearWeight:
    """A loaded layer's weight ([out, in] dense, or GGUF blocks) as `linear` runs it:
    dense float32 ones packed for the native GEMM where the build says it is the fastest
    (cpu_gemm.preferred), else prepacked for oneDNN where that is the faster CPU GEMM.
    Panels replace the dense copy, and every row count runs them (one row included).
    `batch_invariant`: never oneDNN (it picks its blocking by the row count); float32
    weights are packed for the native GEMM wherever it builds (each output one FMA chain
    over `in` in order, whatever rows share its tile), bf16 ones stay dense for the row
    kernel. Run once loading (and sharding) is done: the packed copies do not track later
    edits."""
    if isinstance(weight, GgufWeight):  # the kernel adds a float32 bias
        return LinearWeight(None, None if bias is None else bias.float(),
                            quantized=prepare_gguf(weight), batch_invariant=batch_invariant)
    if weight.dtype == torch.float32 and weight.is_cpu and (batch_invariant
                                                             or cpu_gemm.preferred()):
        panels = cpu_gemm.pack(weight)
        if panels is not None:  # the only copy: every row count runs on it
            return LinearWeight(None, bias, panels=panels, out_features=weight.shape[0],
                                batch_invariant=batch_invariant)
    if batch_invariant:
        return LinearWeight(weight, bias, batch_invariant=True)
    if bf16_panels_preferred() and weight.dtype == torch.bfloat16 and weight.is_cpu \
            and weight.dim() == 2 and weight.shape[1] % 2 == 0:
        panels = cpu_gemm.pack_bf16(weight)
        if panels is not None:  # the only copy: every row count runs on it
            return LinearWeight(None, bias, panels=panels, out_features=weight.shape[0])
    return LinearWeight(weight, bias, packed=cpu_onednn.prepack(weight))


# On AMX builds bf16 panels run on the tiles (gemm_bf16_amx) from this many rows, one row
# on the vdpbf16ps kernel (as the fused single-sequence step does). Over a whole model's
# streamed layers (bench.bench_bf16_gemm, SmolLM2 and Llama-3.2-1B, 2-core Sapphire
# Rapids) the tiles ran 0.97-0.98x the vdpbf16ps kernel at one row, 1.09x at 2, 1.2-1.35x
# at 4 and 2.4-2.7x at 16; against oneDNN's AMX GEMM 1.13-1.45x at 2-64 rows, 0.92-1.0x
# at 256.
BF16_TILES_MIN_ROWS = 2


def bf16_panels_preferred() -> bool:
    """Whether bf16 weights are served as the native GEMM's panels (kernels/cpu/gemm_bf16.c):
    where the build has it and the CPU in use is at the avx512_bf16 or amx level (on AMX
    builds the panels also run on the tiles, BF16_TILES_MIN_ROWS). On a 2-core Zen 4
    (AVX-512 BF16, no AMX), over every layer's
    weights streamed from memory as a step streams them (bench.bench_bf16_gemm), the panels
    ran SmolLM2's 1.18-1.74x oneDNN's prepacked bf16 GEMM at 1-64 rows and 1.04-1.26x at
    128-2048, Llama-3.2-1B's 1.02-1.32x at 1-16 rows and 0.98-1.03x at 32-1024; one row
    0.98-1.05x the dense row kernel, 2-4 rows 1.03-1.33x. On a 2-core Sapphire Rapids
    (AMX) the tiles ran 1.13-1.45x oneDNN's AMX GEMM at 2-64 rows over both models'
    layers (0.92-1.0x at 256-row prefill chunks) and one row 0.97-1.02x the row kernel. So
    they replace the dense copy and oneDNN's (halving the weights' memory) and take every
    row count."""
    return bool(cpu_gemm.bf16_built()) and cpu_features.detect().isa in ("avx512_bf16", "amx")


def unpack_linear(weight: LinearWeight) -> torch.Tensor:
    """The dense [out, in] weight of a prepared one, bit-exact (its panels when packing
    dropped the rows)."""
    if weight.panels is not None and weight.panels.dtype == torch.bfloat16:
        return cpu_gemm.unpack_bf16(weight.panels, weight.out_features, weight.in_features)
    if weight.panels is not None:
        return cpu_gemm.unpack(weight.panels, weight.out_features)
    if weight.dense is None:
        raise ValueError("unpack_linear: GGUF blocks have no exact dense copy")
    return weight.dense


def linear(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """x W^T + b, [tokens, in] -> [tokens, out]. A LinearWeight(dense, bias) built
    without prepare_linear (a model not yet loaded) runs unpacked."""
    if weight.quantized is not None:
        return gguf_linear(x, weight.quantized, weight.bias, weight.batch_invariant)
    if weight.panels is not None:
        rows = x.reshape(-1, x.shape[-1])
        if weight.panels.dtype == torch.bfloat16:
            out = None
            if _on_bf16_tiles(weight, rows):
                out = cpu_gemm.gemm_bf16(rows, weight.panels, weight.out_features,
                                         weight.bias, tiles=True)
            if out is None:
                out = cpu_gemm.gemm_bf16(rows, weight.panels, weight.out_features, weight.bias)
        else:
            out = cpu_gemm.gemm(rows, weight.panels, weight.out_features, weight.bias)
        if out is not None:
            return out.view(*x.shape[:-1], weight.out_features)
        dense = unpack_linear(weight).to(x.dtype)
        if weight.batch_invariant:
            return invariant_linear(x, dense, weight.bias)
        return F.linear(x, dense, weight.bias)
    if weight.batch_invariant:
        return invariant_linear(x, weight.dense, weight.bias)
    out = dense_linear_rows(x, weight.dense, weight.bias)
    if out is not None:
        return out
    if weight.packed is not None:
        return cpu_onednn.linear(x, weight.packed, weight.bias)
    return F.linear(x, weight.dense, weight.bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with each row's sums in one fixed order for any row count, for weights
    without panels: the native row kernel (float32, bf16; it keeps 4 rows of W in L1 while
    every x row meets them, so long chunks read W once), else torch one row at a time."""
    out = None
    if x.dim() == 2 and not x.is_cuda:
        if x.dtype == torch.bfloat16:
            out = cpu_linear.linear_bf16_rows(x, weight, bias)
        elif x.dtype == torch.float32:
            out = cpu_linear.linear_f32_rows(x, weight, bias)
    return out if out is not None else torch_invariant.linear(x, weight, bias)


def gguf_embedding(token_ids: torch.Tensor, weight: GgufWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a quantized embedding table, dequantized -> [tokens, hidden] in `dtype`."""
    out = cpu_linear.dequantize_rows(weight, token_ids)
    if out is None:
        out = weight.dequantize(token_ids.long())
    return out.to(dtype)


def warm_up(key_cache: torch.Tensor, num_heads: int, max_model_len: int,
            max_num_batched_tokens: int) -> None:
    """Compile the device kernels' variants before serving (CUDA: kernels/triton/warmup);
    the CPU kernels are built ahead and need nothing."""
    if key_cache.is_cuda:
        from kernels.triton import warmup as triton_warmup
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        triton_warmup.warm_up_attention(num_heads, num_kv_heads, head_dim, block_size,
                                        key_cache.dtype, key_cache.device, max_model_len,
                                        max_num_batched_tokens)


def build_matmul_primitives(weights: Iterable[tuple[LinearWeight, int]]) -> int:
    """Build oneDNN's primitive for every row bucket each prepacked weight can see, given
    as (weight, most rows it runs); returns how many were built. oneDNN builds one per
    weight shape and bucket on first use and keeps it (~0.5 MB each, kernels/cpu/onednn.py):
    served, that grew the bf16 process's RssAnon for its first minutes and again at every
    batch size it had not met yet (+5.7 MiB / 10 min after a 5-minute warm-up over a
    30-minute soak, AMX host). Built here, the process starts at the size it would grow
    to and stays there. Weights on other paths (native panels, GGUF blocks, the row
    kernel's rows) have nothing to build."""
    seen: set[tuple] = set()
    built = 0
    for weight, max_rows in weights:
        if weight.packed is None or weight.dense is None or weight.batch_invariant:
            continue
        key = (tuple(weight.dense.shape), weight.dense.dtype, weight.bias is not None, max_rows)
        if key in seen:
            continue
        seen.add(key)
        built += cpu_onednn.build_primitives(weight.dense, weight.packed, weight.bias,
                                             DENSE_ROWS_MAX + 1, max_rows)
    return built


def decode_step_plan(layers: list[LayerWeights], num_heads: int, num_kv_heads: int,
                     head_dim: int, rot_half: int, eps: float, scale: float,
                     cos_table: torch.Tensor, sin_table: torch.Tensor,
                     final_norm: torch.Tensor) -> DecodeStepPlan | None:
    """A single sequence's decode step through every layer in one native call (float32
    or bf16 on CPU; kernels/cpu/decode_step.py), or None where it does not apply."""
    return cpu_decode_step.plan(layers, num_heads, num_kv_heads, head_dim, rot_half, eps,
                                scale, cos_table, sin_table, final_norm)


# Rows of one adapter's segment from which torch's matmuls (MKL / oneDNN's GEMM over all
# the rows) beat the native kernel, by the CPU's level (kernels/cpu/features.py; other
# machines: as baseline) and dtype; None: never. bench/bench_lora_dispatch.py, SmolLM2's
# four layers with the loader's block-diagonal fused B, ranks 16 and 64, one thread, on a
# Zen 4 host (2026-12-05, docs/BENCHMARKS.md):
# - AVX-512 builds (16 lanes, 8 rows a pass), float32: native 1.3-2.2x faster at every
#   row count to 2048. bf16 with AVX512_BF16 (the kernel's bf16 pair dot products against
#   oneDNN's AVX512_BF16 GEMM): native 1.03-3.7x at every count to 2048, 1.5-2x for a
#   prefill's segment of 48-row runs.
# - AMX: oneDNN runs torch's bf16 matmuls on the tiles, and beat the previous kernel from
#   64 rows (2026-12-02); the pair kernel has not been measured there, so 64 stays.
# - avx2 builds (the same host capped), float32: native 1.07-1.65x to 16 rows, torch from
#   32-64 (0.83-0.97); bf16: native 14-48x at every count (torch has no bf16 unit).
LORA_TORCH_MIN_ROWS: dict[str, dict[torch.dtype, int | None]] = {
    "baseline": {torch.float32: 64, torch.bfloat16: None},
    "avx2": {torch.float32: 64, torch.bfloat16: None},
    "avx512": {torch.float32: None, torch.bfloat16: None},
    "avx512_bf16": {torch.float32: None, torch.bfloat16: None},
    "amx": {torch.float32: None, torch.bfloat16: 64},
}


def lora_torch_min_rows(dtype: torch.dtype) -> int | None:
    """The segment length from which torch runs an adapter's update on this host."""
    isa = cpu_features.detect().isa
    return LORA_TORCH_MIN_ROWS.get(isa, LORA_TORCH_MIN_ROWS["baseline"]).get(dtype)


def prepare_lora(a: torch.Tensor, b: torch.Tensor) -> LoRAWeights:
    """One adapter's layer update, A [rank, in] and B [out, rank], in the layouts the
    kernels that will run it read: with bf16 pairs where the native kernel runs its bf16
    dot products (kernels/cpu/lora.py)."""
    weights = LoRAWeights.of(a, b)
    if a.dtype == torch.bfloat16 and a.is_cpu and cpu_lora.runs_pairs():
        return replace(weights, pairs=cpu_lora.pairs_of(weights.a, weights.b))
    return weights


def lora_add(x: torch.Tensor, y: torch.Tensor, segments: LoRASegments,
             weights: SegmentWeights, batch_invariant: bool = False) -> None:
    """y[rows of segment g] += (x[rows of g] A_g^T) B_g^T in place: a step's LoRA update
    for one layer, every adapter group at once (kernels/lora_ops.py defines it).
    CUDA: the segmented Triton kernel; CPU: the native one (float32 / bf16, unit column
    strides) for segments shorter than lora_torch_min_rows, torch's shrink and expand for
    the longer ones (a long prefill's) and for what the native kernel does not take.
    `batch_invariant` (CPU): the native kernel for every segment, whose sums run each row
    alone in a fixed order whatever rows share its segment, else torch one row at a time."""
    if batch_invariant and not x.is_cuda:
        if not cpu_lora.lora_add(x, y, segments, weights):
            torch_invariant.lora_add(x, y, segments, weights)
        return
    if x.is_cuda:
        if _triton_lora_fits(x, y, weights):
            from kernels.triton import lora as triton_lora
            triton_lora.lora_add(x, y, segments, weights)
            return
    else:
        short, long = split_lora_segments(x, segments, weights)
        if long is None:
            if cpu_lora.lora_add(x, y, segments, weights):
                return
        else:
            # A None weight is a segment the kernel skips: each side runs its own segments.
            if short is not None and cpu_lora.lora_add(x, y, segments, short):
                weights = long
    lora_ops.lora_add(x, y, segments, weights)


def split_lora_segments(x: torch.Tensor, segments: LoRASegments, weights: SegmentWeights
                        ) -> tuple[SegmentWeights | None, SegmentWeights | None]:
    """(the native kernel's weights, torch's): each segment's weights on one side and None
    on the other, by its row count against lora_torch_min_rows; None for a side without
    segments (long None: all are the native kernel's)."""
    threshold = lora_torch_min_rows(x.dtype)
    if threshold is None or segments.max_rows < threshold:
        return weights, None
    sizes = segments.starts.diff().tolist()
    is_long = [n >= threshold for n in sizes]
    short = [None if big else w for w, big in zip(weights, is_long)]
    long = [w if big else None for w, big in zip(weights, is_long)]
    return (short if any(w is not None for w in short) else None), long


def _triton_lora_fits(x: torch.Tensor, y: torch.Tensor, weights: SegmentWeights) -> bool:
    return (x.dim() == 2 and y.dtype == x.dtype and x.stride(1) == 1 and y.stride(1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(w is None or (w.a.dtype == x.dtype and w.b.dtype == x.dtype
                                  and w.in_kernel_layout())
                    for w in weights))
