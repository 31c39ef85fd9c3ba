"""Dense linear layers: how a loaded weight is laid out once (prepare_linear) and which
GEMM runs it for a given row count (linear); the MLP's gate_up ending in silu_mul; the
fused single-sequence decode step."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kernels.cpu import decode_step as cpu_decode_step
from kernels.cpu import features as cpu_features
from kernels.cpu import gemm as cpu_gemm
from kernels.cpu import linear as cpu_linear
from kernels.cpu import onednn as cpu_onednn
from kernels import torch_invariant
from kernels.cpu.decode_step import DecodeStepPlan, LayerWeights
from kernels.gguf_weight import GgufWeight
from kernels.dispatch import elementwise
from kernels.dispatch.gguf import gguf_linear, prepare_gguf
from kernels.linear_weight import LinearWeight


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
    return elementwise.silu_mul(linear(x, weight))


def _on_bf16_tiles(weight: LinearWeight, rows: torch.Tensor) -> bool:
    # bf16 panels run on AMX tiles from BF16_TILES_MIN_ROWS rows (one row stays on
    # vdpbf16ps, the fused single-sequence step's bits), for linear and gate_up_silu alike.
    # Batch-invariant bf16 weights never hold panels (prepare_linear), so never get here.
    return (weight.panels is not None and weight.panels.dtype == torch.bfloat16
            and rows.shape[0] >= BF16_TILES_MIN_ROWS and bool(cpu_gemm.bf16_amx_built()))


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
                     final_norm: torch.Tensor, qk_eps: float | None = None,
                     gemma: bool = False,
                     max_rows: int | None = None) -> DecodeStepPlan | None:
    """A single sequence's decode step through every layer in one native call (float32
    or bf16 on CPU; kernels/cpu/decode_step.py), or None where it does not apply.
    `qk_eps`: the q/k norms' epsilon, where layers have them (Qwen3, Gemma 3); `gemma`:
    the layers are Gemma's ((1 + w) norms, four a layer, GeGLU); `max_rows`: the most
    tokens of the sequence a step takes (a speculative verification's; None: the
    kernel's choice for the weight format and host)."""
    return cpu_decode_step.plan(layers, num_heads, num_kv_heads, head_dim, rot_half, eps,
                                scale, cos_table, sin_table, final_norm, qk_eps, gemma,
                                max_rows)
