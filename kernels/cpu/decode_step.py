"""One decode step of a single sequence through the whole layer stack in one native call
(kernels/cpu/decode_step.c): bit-equal to the layer-by-layer path, without its ~10
Python-level kernel calls a layer.

The model describes itself once (`DecodeStepPlan`: weight pointers, shapes, its KV
cache); a step then passes the tokens' embeddings, positions, and each KV group's slots and
block table. A step takes 1 to `max_rows` tokens of the sequence at consecutive positions
(a speculative verification: the last token and its drafts), each row bit-equal to the
one-row step of that token (decode_step.c's header). Applies on CPU to float32 or bf16
models (activations, norms, rope tables and KV cache in one dtype) with dense weights in
that dtype, GEMM panels in that dtype or
GGUF Q4_0/Q4_1/Q8_0 blocks; `plan` returns None otherwise and the caller keeps its own
path. A layer may add per-head q/k RMSNorms before RoPE (Qwen3, Gemma 3), a sliding
window, a logit soft cap and RoPE tables of its own; the whole stack may be Gemma's layer
instead of Llama's (`gemma`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch

from kernels.cpu import gemm as cpu_gemm
from kernels.cpu import native as cpu_native
from kernels.gguf_weight import FORMATS, GgufWeight
from kernels.linear_weight import LinearWeight
from kernels.validation import MAX_WINDOW

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class _Linear(ctypes.Structure):
    _fields_ = [("type", _I64), ("weight", _P), ("scales", _P), ("offsets", _P), ("bias", _P),
                ("n", _I64), ("k", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _P), ("post_norm", _P), ("pre_ff_norm", _P),
                ("post_ff_norm", _P), ("key_cache", _P), ("value_cache", _P),
                ("q_norm", _P), ("k_norm", _P), ("cos_table", _P), ("sin_table", _P),
                ("window", _I64), ("group", _I64), ("soft_cap", ctypes.c_double)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64),
                ("num_kv_heads", _I64), ("head_dim", _I64), ("rot_half", _I64), ("inter", _I64),
                ("block_size", _I64), ("is_bf16", _I64), ("gemma", _I64),
                ("eps", ctypes.c_double), ("scale", ctypes.c_double),
                ("qk_eps", ctypes.c_double), ("final_norm", _P),
                ("layers", ctypes.POINTER(_Layer))]


class _Group(ctypes.Structure):
    _fields_ = [("block_table", _P), ("slots", _P)]


# The most rows a plan takes unless told (decode_step.c takes up to 64): a token and up to
# 15 drafts. Over bf16 GEMM panels on an AMX host, AMX_PANEL_ROWS: the fused rows run
# gemm_bf16's vdpbf16ps (what one row runs, so that rows stay bit-equal to one-row steps),
# so each row costs its own pass of arithmetic, where the layer path's multi-row steps
# run AMX tiles at nearly one row's cost but pay ~3-5 ms of Python-level calls. Small
# models gain (SmolLM2-135M bf16, 2-core Sapphire Rapids: 2 to 5 rows fused beat the
# layer path by 3-4 ms, 9 rows lost to it); past AMX_PANEL_BYTES of weights the
# arithmetic wins (a 1B shape: 5 rows fused 132 ms, layer path 110 ms), so such a
# model's multi-row steps keep the layer path.
MAX_ROWS = 16
AMX_PANEL_ROWS = 5
AMX_PANEL_BYTES = 512 * 1024**2


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind({
        "decode_step_scratch_floats": (_I64, [ctypes.POINTER(_Model)]),
        "decode_step_rows": (_I32, [ctypes.POINTER(_Model), _P, _P, _P, _I64, _P,
                                    ctypes.POINTER(_Group), _I32, _I32])})


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer as the kernel sees it: each matmul's weight an [out, in] tensor in
    the model's dtype or GGUF blocks, with an optional bias (the model's dtype, float32
    beside GGUF blocks; the oneDNN copy is not read)."""
    qkv: LinearWeight
    o: LinearWeight
    gate_up: LinearWeight
    down: LinearWeight
    input_norm: torch.Tensor
    post_norm: torch.Tensor  # Gemma: the attention branch's post-norm
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    # Per-head RMSNorm weights [head_dim] of q and k before RoPE (Qwen3, Gemma 3): both or
    # neither.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # Keys a decode row sees, itself included (the attention's sliding_window); None: all.
    window: int | None = None
    # Attention logits -> soft_cap * tanh(logit / soft_cap) (Gemma 2); None: off.
    soft_cap: float | None = None
    # This layer's RoPE tables where they are not the plan's (Gemma 3's local layers).
    cos_table: torch.Tensor | None = None
    sin_table: torch.Tensor | None = None
    # Gemma's MLP norms, before it and on its output: both for a Gemma plan, else neither.
    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None


# The dense weight types of decode_step.c's linear_t (GGUF blocks carry their type id).
_DENSE = {torch.float32: -1, torch.bfloat16: -2}
_PANELS = {torch.float32: -3, torch.bfloat16: -4}


def _cpu(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.is_cpu and t.is_contiguous())


def _linear(linear: LinearWeight, dtype: torch.dtype) -> _Linear | None:
    if linear.panels is not None:  # the layer-by-layer path runs the same gemm call
        panels, bias = linear.panels, linear.bias
        if not _cpu(panels, dtype) or not _cpu(bias, dtype):
            return None
        return _Linear(_PANELS[dtype], panels.data_ptr(), None, None,
                       None if bias is None else bias.data_ptr(), linear.out_features,
                       linear.in_features)
    weight, bias = linear.table, linear.bias
    if isinstance(weight, GgufWeight):
        if not weight.qs.is_cpu or weight.type_name not in FORMATS or not _cpu(bias, torch.float32):
            return None
        type_id, qs, d, offset, n, k = weight.kernel_args
        return _Linear(type_id, qs, d, offset or None, None if bias is None else bias.data_ptr(),
                       n, k)
    if not _cpu(weight, dtype) or weight.dim() != 2 or not _cpu(bias, dtype):
        return None
    return _Linear(_DENSE[dtype], weight.data_ptr(), None, None,
                   None if bias is None else bias.data_ptr(), weight.shape[0], weight.shape[1])


class DecodeStepPlan:
    """The descriptors and scratch of one model over one KV cache; holds references to
    every tensor it points at. A step takes 1 to `max_rows` rows."""

    def __init__(self, model: _Model, layers: ctypes.Array, keep: list,
                 scratch: torch.Tensor, max_rows: int) -> None:
        self._model, self._layers, self._keep, self._scratch = model, layers, keep, scratch
        self.hidden = model.hidden
        self.max_rows = max_rows
        self.dtype = torch.bfloat16 if model.is_bf16 else torch.float32
        # Each layer's KV group, as the last step's metadata had them: every layer in
        # group 0 until a step says otherwise.
        self._layer_groups: tuple[int, ...] = (0,) * model.num_layers
        self._groups = (_Group * model.num_layers)()
        self._model_ref = ctypes.byref(model)

    def run(self, embedding: torch.Tensor, positions: torch.Tensor, slots: list[torch.Tensor],
            block_tables: list[torch.Tensor], seq_len: int,
            layer_groups: tuple[int, ...] | None = None) -> torch.Tensor | None:
        """[T, hidden] final-norm outputs (the model's dtype) for the T tokens whose
        embeddings [T, hidden] are given (1 <= T <= max_rows, at consecutive positions
        `positions`, int64 [T]), writing their K/V at their KV group's slots; None if the
        step does not fit or a kernel refused (the caller's path reruns). Group g's slots
        (int64 [T]) and block table (the sequence's row, int32 contiguous) are slots[g]
        and block_tables[g]; seq_len counts the context through the last row; layer l is
        in group layer_groups[l] (None: all in group 0)."""
        rows = embedding.shape[0]
        if (embedding.dtype != self.dtype or not 1 <= rows <= self.max_rows
                or embedding.shape[1] != self.hidden or not embedding.is_contiguous()
                or not _int64_rows(positions, rows)):
            return None
        if layer_groups is None:
            layer_groups = (0,) * self._model.num_layers
        if (len(layer_groups) != self._model.num_layers or len(slots) != len(block_tables)
                or len(slots) > len(self._groups) or max(layer_groups) >= len(slots)):
            return None
        if layer_groups != self._layer_groups:
            for entry, group in zip(self._layers, layer_groups):
                entry.group = group
            self._layer_groups = layer_groups
        for entry, slot, table in zip(self._groups, slots, block_tables):
            if not _int64_rows(slot, rows):
                return None
            entry.block_table, entry.slots = table.data_ptr(), slot.data_ptr()
        out = torch.empty(rows, self.hidden, dtype=self.dtype)
        status = _library().decode_step_rows(
            self._model_ref, embedding.data_ptr(), out.data_ptr(), self._scratch.data_ptr(),
            rows, positions.data_ptr(), self._groups, seq_len - rows + 1,
            torch.get_num_threads())
        return out if status == 0 else None


def _int64_rows(t: torch.Tensor, rows: int) -> bool:
    return t.dtype == torch.int64 and t.is_cpu and t.is_contiguous() and t.shape == (rows,)


def plan(layers: list[LayerWeights], num_heads: int, num_kv_heads: int, head_dim: int,
         rot_half: int, eps: float, scale: float, cos_table: torch.Tensor,
         sin_table: torch.Tensor, final_norm: torch.Tensor,
         qk_eps: float | None = None, gemma: bool = False,
         max_rows: int | None = None) -> DecodeStepPlan | None:
    """None when the fused step does not apply (no library, a GPU tensor, a dtype other
    than float32 / bf16 or mixed dtypes, a weight format the kernel lacks); the
    layer-by-layer path then serves. The model's dtype is final_norm's; `qk_eps` is the
    q/k norms' epsilon, needed where a layer has them. `gemma`: every layer is Gemma's
    ((1 + w) norms, each with its MLP norms, GeGLU), the final norm too. `max_rows`: the
    most tokens a step takes (the scratch holds that many rows; None: MAX_ROWS, or over
    bf16 panels where gemm_bf16 carries AMX AMX_PANEL_ROWS, 1 past AMX_PANEL_BYTES)."""
    dtype = final_norm.dtype
    if max_rows is not None and not 1 <= max_rows <= 64:
        return None
    if _library() is None or not layers or dtype not in _DENSE:
        return None
    if not all(_cpu(t, dtype) for t in (cos_table, sin_table, final_norm)):
        return None
    block_size = layers[0].key_cache.shape[1]
    table = (_Layer * len(layers))()
    for entry, layer in zip(table, layers):
        linears = [_linear(w, dtype) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        cos, sin = layer.cos_table, layer.sin_table
        if (cos is None) != (sin is None):
            return None
        cos, sin = (cos_table, sin_table) if cos is None else (cos, sin)
        ff_norms = (layer.pre_ff_norm, layer.post_ff_norm)
        if any((n is None) == gemma for n in ff_norms):
            return None
        tensors = (layer.key_cache, layer.value_cache, layer.input_norm, layer.post_norm, cos,
                   sin, *ff_norms)
        if (any(lin is None for lin in linears) or not all(_cpu(t, dtype) for t in tensors)
                or layer.key_cache.shape[1] != block_size or cos.shape != cos_table.shape
                or sin.shape != sin_table.shape):
            return None
        if layer.soft_cap is not None:
            if not layer.soft_cap > 0:
                return None
            entry.soft_cap = layer.soft_cap
        if gemma:
            entry.pre_ff_norm, entry.post_ff_norm = (n.data_ptr() for n in ff_norms)
        entry.cos_table, entry.sin_table = cos.data_ptr(), sin.data_ptr()
        if (layer.q_norm is None) != (layer.k_norm is None):
            return None
        if layer.q_norm is not None:
            if (qk_eps is None or not _cpu(layer.q_norm, dtype) or not _cpu(layer.k_norm, dtype)
                    or layer.q_norm.numel() != head_dim or layer.k_norm.numel() != head_dim):
                return None
            entry.q_norm, entry.k_norm = layer.q_norm.data_ptr(), layer.k_norm.data_ptr()
        if layer.window is not None:
            if layer.window < 1:
                return None
            # The clamp the layer path's decode call applies (kernels/cpu/native.py).
            entry.window = min(layer.window, MAX_WINDOW)
        entry.qkv, entry.o, entry.gate_up, entry.down = linears
        entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
        entry.key_cache = layer.key_cache.data_ptr()
        entry.value_cache = layer.value_cache.data_ptr()
    if max_rows is None:
        bf16_panels = any(lin.type == _PANELS[torch.bfloat16]
                          for entry in table for lin in (entry.qkv, entry.o, entry.gate_up,
                                                         entry.down))
        max_rows = MAX_ROWS
        if bf16_panels and cpu_gemm.bf16_amx_built():
            weight_bytes = sum(2 * lin.n * lin.k for entry in table
                               for lin in (entry.qkv, entry.o, entry.gate_up, entry.down))
            max_rows = AMX_PANEL_ROWS if weight_bytes <= AMX_PANEL_BYTES else 1
    hidden = final_norm.shape[0]
    inter = layers[0].down.in_features
    model = _Model(len(layers), hidden, num_heads, num_kv_heads, head_dim, rot_half, inter,
                   block_size, int(dtype == torch.bfloat16), int(gemma), eps, scale,
                   eps if qk_eps is None else qk_eps, final_norm.data_ptr(), table)
    scratch = torch.empty(max_rows * _library().decode_step_scratch_floats(ctypes.byref(model)),
                          dtype=torch.float32)
    return DecodeStepPlan(model, table, [layers, cos_table, sin_table, final_norm], scratch,
                          max_rows)
