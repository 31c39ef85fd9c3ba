"""CPU kernels in C (kernels/cpu/*.c), built once with the system C compiler and
loaded with ctypes.

Why: the torch path of decode attention gathers every sequence's K/V into a padded
copy per layer per step, which made attention cost as much as all the matmuls at
contexts of a few hundred tokens; the C kernel reads K/V in place through the block
table. The element-wise kernels (bf16 and float32, the dtype the engine runs in where
the CPU has no native bf16) fuse op chains whose launches and memory passes cost more
than their arithmetic at decode batch sizes. When no compiler is available, or a
shape or dtype is outside what a kernel handles, a function here returns None (False for
KV writes) and kernels.dispatch, its only caller in the engine, runs the torch version in
kernels/torch_ops.py, which defines the semantics.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from kernels.cpu import features as cpu_features
from kernels.validation import MAX_WINDOW

logger = logging.getLogger(__name__)
SOURCES = sorted(Path(__file__).parent.glob("*.c"))
# -ffast-math is for compiling only: gcc links crtfastmath.o into anything *linked*
# with it, and that object turns on flush-to-zero for the whole process at load time,
# silently changing torch's numerics. Hence two steps.
# -Wno-psabi: the baseline build passes vector types between static functions, where the
# ABI note gcc prints for them cannot matter.
COMPILE_FLAGS = ["-O3", "-ffast-math", "-fPIC", "-fopenmp", "-Wno-psabi", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def _cache_dir() -> Path:
    root = os.environ.get("TLE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "triton-llm-engine")
    return Path(root) / "cpu_kernels"


def build_shared(compiler: str, compile_flags: list[str], sources: list[Path], work_dir: str,
                 lib_path: str) -> str | None:
    """Compile each source with compile_flags (COMPILE_FLAGS and more) into work_dir, then
    link them into lib_path with LINK_FLAGS alone; None, or the failing command's stderr."""
    objects = [os.path.join(work_dir, f"{src.stem}.o") for src in sources]
    commands = [[compiler, *compile_flags, str(src), "-o", obj]
                for src, obj in zip(sources, objects)]
    commands.append([compiler, *objects, *LINK_FLAGS, "-o", lib_path])
    # LC_ALL=C keeps gcc's messages plain ASCII, and the bytes are decoded as UTF-8 with
    # replacement whatever the locale: inside Triton's python stub the locale decodes
    # ASCII, and gcc's curly quotes in a mere warning made the first build raise there.
    env = {**os.environ, "LC_ALL": "C"}
    for cmd in commands:
        result = subprocess.run(cmd, capture_output=True, env=env)
        if result.returncode != 0:
            return result.stderr.decode("utf-8", errors="replace").strip()
    return None


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    if os.environ.get("TLE_DISABLE_NATIVE_CPU_KERNELS") == "1":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found; the CPU kernels (attention, fused element-wise "
                       "ops, KV writes) use the slower torch path")
        return None
    features = cpu_features.detect()
    compile_flags = [*COMPILE_FLAGS, *features.compile_flags()]
    # The build targets this CPU (or the capped level): it is only valid on CPUs with the
    # same features, and the cache directory may be shared (a home on NFS, an image built
    # on another host).
    digest = hashlib.sha256(" ".join(compile_flags + LINK_FLAGS).encode() + features.machine.encode()
                            + " ".join(sorted(features.flags)).encode())
    for source in [*SOURCES, *SOURCES[0].parent.glob("*.h")]:
        digest.update(source.read_bytes())
    target = _cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename, so concurrent first starts never load a
        # half-written library.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            lib_path = os.path.join(tmp, "kernels.so")
            error = build_shared(compiler, compile_flags, SOURCES, tmp, lib_path)
            if error is not None:
                logger.warning("building the CPU kernels for %s failed; the torch path "
                               "runs instead: %s", features.describe(), error[-2000:])
                return None
            os.replace(lib_path, target)
    lib = ctypes.CDLL(str(target))
    logger.info("native CPU kernels loaded for %s (%s)", features.describe(), target.name)
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "paged_decode_attention": (ctypes.c_int, [ptr] * 6 + [i32] * 6 + [f32, i32, i32]),
        "paged_decode_attention_windowed": (ctypes.c_int,
                                            [ptr] * 6 + [i32] * 6 + [f32, i32, f32, i32, i32]),
        "add_rms_norm_bf16": (None, [ptr] * 4 + [i64, i64, f32, i32]),
        "silu_mul_bf16": (None, [ptr, ptr, i64, i64, i32]),
        "argmax_bf16": (None, [ptr, ptr, i64, i64, i32]),
        "argmax_f32": (None, [ptr, ptr, i64, i64, i32]),
        "rope_bf16": (None, [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i32]),
        "reshape_and_cache_16": (None, [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i32]),
        "add_rms_norm_f32": (None, [ptr] * 4 + [i64, i64, f32, i32]),
        "silu_mul_f32": (None, [ptr, ptr, i64, i64, i32]),
        "rope_f32": (None, [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i32]),
        "reshape_and_cache_32": (None, [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i32]),
        "gemma_rms_norm_bf16": (None, [ptr] * 4 + [i64, i64, f32, i32]),
        "gemma_rms_norm_f32": (None, [ptr] * 4 + [i64, i64, f32, i32]),
        "gelu_tanh_mul_bf16": (None, [ptr, ptr, i64, i64, i32]),
        "gelu_tanh_mul_f32": (None, [ptr, ptr, i64, i64, i32]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib



def bind(signatures: dict[str, tuple]) -> ctypes.CDLL | None:
    """The library with these functions' ctypes result and argument types set ({name:
    (restype, argtypes)}), for the wrappers of the other C files; None without it."""
    lib = load_library()
    if lib is None:
        return None
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib

# The element-wise kernels' dtypes; anything else (float16, float64) takes the torch path.
_ELEMENTWISE = (torch.bfloat16, torch.float32)


def _cpu_contiguous(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    # is_cpu rather than device.type: these checks run ~100 times a decode step, and
    # building a device object costs more than the float32 kernels' work at one row.
    return all(t.dtype == dtype and t.is_cpu and t.is_contiguous() for t in tensors)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """residual += x (in place, if x is given); returns rms_norm(residual) * weight, or
    None when the fused kernel does not apply (not bf16/float32, contiguous, CPU; no library)."""
    return _row_norm("add_rms_norm", x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor | None:
    """As add_rms_norm with Gemma's (1 + weight) scale, applied in float32 before the one
    rounding to the dtype (layers.GemmaRMSNorm)."""
    return _row_norm("gemma_rms_norm", x, residual, weight, eps)


def _row_norm(name: str, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
              eps: float) -> torch.Tensor | None:
    lib = load_library()
    operands = (residual, weight) if x is None else (x, residual, weight)
    if (lib is None or residual.dim() != 2 or residual.dtype not in _ELEMENTWISE
            or not _cpu_contiguous(residual.dtype, *operands)):
        return None
    kernel = getattr(lib, f"{name}_{'bf16' if residual.dtype == torch.bfloat16 else 'f32'}")
    out = torch.empty_like(residual)
    kernel(None if x is None else x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
           out.data_ptr(), residual.shape[0], residual.shape[1], float(eps),
           torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up = [gate | up] along the last dim; None if not applicable."""
    return _gated("silu_mul", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu(gate, approximate="tanh") * up (Gemma's GeGLU), as silu_mul."""
    return _gated("gelu_tanh_mul", gate_up)


def _gated(name: str, gate_up: torch.Tensor) -> torch.Tensor | None:
    lib = load_library()
    if (lib is None or gate_up.dim() != 2 or gate_up.dtype not in _ELEMENTWISE
            or not _cpu_contiguous(gate_up.dtype, gate_up)):
        return None
    kernel = getattr(lib, f"{name}_{'bf16' if gate_up.dtype == torch.bfloat16 else 'f32'}")
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Row-wise argmax (first maximum) of a 2-D bf16 or float32 CPU tensor; None if not
    applicable."""
    lib = load_library()
    if (lib is None or x.dim() != 2 or x.dtype not in _ELEMENTWISE
            or not _cpu_contiguous(x.dtype, x)):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernel = lib.argmax_bf16 if x.dtype == torch.bfloat16 else lib.argmax_f32
    kernel(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor | None:
    """Same contract as torch_ops.decode_attention (window and soft cap included); None
    when this kernel cannot run (the caller then uses the torch path)."""
    lib = load_library()
    is_bf16 = _DTYPES.get(query.dtype)
    if lib is None or is_bf16 is None or key_cache.dtype != query.dtype:
        return None
    query = query.contiguous()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    num_seqs, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    status = lib.paged_decode_attention_windowed(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), lens.data_ptr(), num_seqs, num_heads, key_cache.shape[2], head_dim,
        key_cache.shape[1], tables.shape[1], float(scale),
        min(sliding_window or 0, MAX_WINDOW), float(soft_cap or 0.0), is_bf16,
        torch.get_num_threads())
    return out if status == 0 else None


def rope(qkv: torch.Tensor, num_heads: int, head_dim: int, rot_half: int, positions: torch.Tensor,
         cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half RoPE of the first num_heads heads of each row of a 2-D bf16 or float32
    buffer (rows may be longer: the fused qkv layout) -> contiguous [rows, num_heads,
    head_dim]. The cos/sin tables must have the buffer's dtype, as RotaryEmbedding builds
    them in the model dtype. None if not applicable."""
    lib = load_library()
    if (lib is None or qkv.dim() != 2 or qkv.dtype not in _ELEMENTWISE or not qkv.is_cpu
            or not _cpu_contiguous(qkv.dtype, cos_table, sin_table)
            or positions.dtype != torch.int64 or not positions.is_contiguous()):
        return None
    row_stride, column_stride = qkv.stride()
    if column_stride != 1:
        return None
    kernel = lib.rope_bf16 if qkv.dtype == torch.bfloat16 else lib.rope_f32
    rows = qkv.shape[0]
    out = torch.empty(rows, num_heads, head_dim, dtype=qkv.dtype)
    kernel(qkv.data_ptr(), row_stride, rows, num_heads, head_dim, rot_half,
           positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(), out.data_ptr(),
           torch.get_num_threads())
    return out


def _rows_view(t: torch.Tensor) -> int | None:
    """Row stride of a [T, KVH, D] tensor whose rows are each contiguous, else None."""
    if t.dim() != 3:
        return None
    stride = t.stride()
    return stride[0] if stride[2] == 1 and stride[1] == t.shape[2] else None


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Write K/V rows to their slots (-1 skipped) in one pass, reading strided views in
    place; bf16, float16 and float32. Returns False (nothing written) when not applicable."""
    lib = load_library()
    if (lib is None or key.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype)
            or not key.is_cpu or slot_mapping.dtype != torch.int64
            or not (key_cache.is_contiguous() and value_cache.is_contiguous()
                    and slot_mapping.is_contiguous())):
        return False
    key_stride, value_stride = _rows_view(key), _rows_view(value)
    if key_stride is None or value_stride is None:
        return False
    # The copy moves whole elements: 2-byte dtypes share one kernel, float32 has its own.
    kernel = lib.reshape_and_cache_32 if key.dtype == torch.float32 else lib.reshape_and_cache_16
    kernel(key.data_ptr(), key_stride, value.data_ptr(), value_stride, key_cache.data_ptr(),
           value_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
           key.shape[1] * key.shape[2], torch.get_num_threads())
    return True
