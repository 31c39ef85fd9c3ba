"""Shared by the A/B benches that time one native kernel source at two revisions in one
process (bench_decode_attention_ab, bench_row_kernels_ab): the old source from git, each
side built alone into a shared library with the engine's compile flags for this host."""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from kernels.cpu import features as cpu_features
from kernels.cpu import native as cpu_native

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "kernels" / "cpu"


def source_at(revision: str, path: str) -> str:
    """`path`'s text at a git revision."""
    return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def build(source_text: str, out_dir: Path, name: str) -> ctypes.CDLL:
    """One C source (headers from the working tree) -> a loaded shared library."""
    src = out_dir / f"{name}.c"
    src.write_text(source_text)
    lib = out_dir / f"{name}.so"
    flags = [f for f in cpu_native.COMPILE_FLAGS if f != "-c"]
    subprocess.run(["cc", *flags, *cpu_features.detect().compile_flags(), f"-I{INCLUDE}",
                    "-shared", str(src), "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))
