"""The CPU decode-attention kernel in C (kernels/cpu/decode_attention.c), built once
with the system C compiler and loaded with ctypes.

Why: the torch path gathers every sequence's K/V into a padded copy per layer per
step, which made attention cost as much as all the matmuls at contexts of a few
hundred tokens. The C kernel reads K/V in place through the block table. When no
compiler is available, or the shape or dtype is outside what it handles, callers fall
back to the torch implementation (kernels/reference.py), which defines the semantics.
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

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "decode_attention.c"
# -ffast-math is for compiling only: gcc links crtfastmath.o into anything *linked*
# with it, and that object turns on flush-to-zero for the whole process at load time,
# silently changing torch's numerics. Hence two steps.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-fopenmp", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}


def _cache_dir() -> Path:
    root = os.environ.get("TLE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "triton-llm-engine")
    return Path(root) / "cpu_kernels"


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    if os.environ.get("TLE_DISABLE_NATIVE_CPU_KERNELS") == "1":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found; CPU decode attention uses the slower torch path")
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(COMPILE_FLAGS + LINK_FLAGS).encode()
                         + os.uname().machine.encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename, so concurrent first starts never load a
        # half-written library.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            obj, lib_path = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
            for cmd in ([compiler, *COMPILE_FLAGS, str(SOURCE), "-o", obj],
                        [compiler, obj, *LINK_FLAGS, "-o", lib_path]):
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    logger.warning("building the CPU attention kernel failed, using torch: %s",
                                   result.stderr.strip()[-2000:])
                    return None
            os.replace(lib_path, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
    return lib


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor | None:
    """Same contract as reference.decode_attention; None when this kernel cannot run
    (the caller then uses the torch path)."""
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
    status = lib.paged_decode_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), lens.data_ptr(), num_seqs, num_heads, key_cache.shape[2], head_dim,
        key_cache.shape[1], tables.shape[1], float(scale), is_bf16, torch.get_num_threads())
    return out if status == 0 else None
