"""Shared by the A/B benches that time one native kernel source at two revisions in one
process (bench_decode_attention_ab, bench_row_kernels_ab): the old source from git, each
side built alone into a shared library with the engine's compile flags for this host."""
from __future__ import annotations

import ctypes
import subprocess
import time
from collections.abc import Callable
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
    """One C source (headers from the working tree) -> a loaded shared library, built as
    the engine's library is (cpu_native.build_shared: -ffast-math when compiling only)."""
    src, lib = out_dir / f"{name}.c", out_dir / f"{name}.so"
    src.write_text(source_text)
    flags = [*cpu_native.COMPILE_FLAGS, *cpu_features.detect().compile_flags(), f"-I{INCLUDE}"]
    error = cpu_native.build_shared("cc", flags, [src], str(out_dir), str(lib))
    if error is not None:
        raise RuntimeError(f"building {name} failed: {error}")
    return ctypes.CDLL(str(lib))


def best_alternated(run: Callable[[str], None], repeats: int, calls: int) -> dict[str, float]:
    """Each side's best mean seconds over `calls` runs (after one untimed), `repeats` rounds,
    old first in even rounds and new first in odd ones."""
    best = {"old": float("inf"), "new": float("inf")}
    for round_ in range(repeats):
        for side in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
            run(side)
            start = time.perf_counter()
            for _ in range(calls):
                run(side)
            best[side] = min(best[side], (time.perf_counter() - start) / calls)
    return best


def report(label: str, best: dict[str, float], nbytes: int, unit: str, outcome: str) -> str:
    """One line: each side's time in `unit` (ms or us) and bytes per second, old / new."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    sides = "".join(f"  {side} {best[side] * scale:7.2f} {unit}"
                    f" ({nbytes / best[side] / 1e9:5.1f} GB/s)" for side in ("old", "new"))
    return f"{label}{sides}  old/new {best['old'] / best['new']:5.2f}  {outcome}"
