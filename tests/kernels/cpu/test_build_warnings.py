"""Every kernel source builds without a warning at each level the engine builds for, named
explicitly so the result does not depend on this host; and a build whose compiler prints
non-ASCII text still loads in a process whose locale decodes ASCII (Triton's python stub
runs in the C locale: gcc's curly quotes in a warning once kept a fresh machine from serving)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels.cpu import native as cpu_native
from kernels.cpu.features import _MARCH

GCC = shutil.which("gcc")
# gcc 12 does not know -march=znver4; its feature set spelled out is what a Zen 4 with
# such a gcc gets from -march=native.
ZNVER4_FLAGS = ["-march=znver3", "-mavx512f", "-mavx512cd", "-mavx512dq", "-mavx512bw",
                "-mavx512vl", "-mavx512ifma", "-mavx512vbmi", "-mavx512vbmi2", "-mavx512vnni",
                "-mavx512bitalg", "-mavx512vpopcntdq", "-mavx512bf16", "-mgfni", "-mvaes",
                "-mvpclmulqdq"]


def _knows(march: str) -> bool:
    probe = subprocess.run([GCC, f"-march={march}", "-x", "c", "-E", "-", "-o", os.devnull],
                           input=b"", capture_output=True)
    return probe.returncode == 0


def _levels() -> dict[str, list[str]]:
    # The capped levels the engine builds (x86-64-v3, -v4), the two CPUs its real builds
    # are most often for, and this host's own -march=native (whose tuning parameters
    # change inlining: the old -Wstringop-overflow showed only there on Sapphire Rapids).
    return {"avx2": _MARCH["avx2"], "avx512": _MARCH["avx512"],
            "znver4": ["-march=znver4"] if _knows("znver4") else ZNVER4_FLAGS,
            "sapphirerapids": ["-march=sapphirerapids"], "native": ["-march=native"]}


@pytest.mark.skipif(GCC is None, reason="no gcc")
@pytest.mark.parametrize("level", ["avx2", "avx512", "znver4", "sapphirerapids", "native"])
def test_every_source_builds_without_a_warning(level, tmp_path):
    march = _levels()[level]
    flags = [*cpu_native.COMPILE_FLAGS, *march, "-Wall", "-Werror"]

    def build(source: Path) -> tuple[str, int, str]:
        result = subprocess.run([GCC, *flags, str(source), "-o", str(tmp_path / f"{source.stem}.o")],
                                capture_output=True, env={**os.environ, "LC_ALL": "C"})
        return source.name, result.returncode, result.stderr.decode("utf-8", "replace")

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [(name, err) for name, rc, err in pool.map(build, cpu_native.SOURCES) if rc]
    assert not failures, f"{' '.join(march)}: " + "\n".join(f"{n}:\n{e}" for n, e in failures)


def test_the_warning_check_catches_a_warning(tmp_path):
    """The flags above turn a warning into a failure (a check that could not fail says nothing)."""
    if GCC is None:
        pytest.skip("no gcc")
    source = tmp_path / "w.c"
    source.write_text("int f(void) { int unused; return 0; }\n")
    result = subprocess.run([GCC, *cpu_native.COMPILE_FLAGS, "-Wall", "-Werror", str(source),
                             "-o", str(tmp_path / "w.o")], capture_output=True)
    assert result.returncode != 0


def ascii_locale_env(**extra: str) -> dict[str, str]:
    """The environment of a process that decodes text as ASCII, as Triton's stub does: no
    LANG / LC_*, and none of Python's own ways around the C locale."""
    env = {k: v for k, v in os.environ.items()
           if not (k == "LANG" or k.startswith("LC_") or k in ("PYTHONUTF8", "PYTHONIOENCODING"))}
    env.update(PYTHONUTF8="0", PYTHONCOERCECLOCALE="0", LC_ALL="C", **extra)
    return env


def noisy_compiler(folder: Path) -> Path:
    """A cc that prints gcc-style curly quotes (UTF-8) on stderr, then compiles."""
    wrapper = folder / "cc-with-quotes"
    wrapper.write_text("#!/bin/sh\n"
                       "printf 'cc1: warning: \\342\\200\\230memcpy\\342\\200\\231 writes past "
                       "\\342\\200\\230block\\342\\200\\231\\n' >&2\n"
                       f"exec {GCC} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.skipif(GCC is None, reason="no gcc")
def test_a_build_with_non_ascii_compiler_output_loads_in_an_ascii_locale(tmp_path):
    env = ascii_locale_env(CC=str(noisy_compiler(tmp_path)), TLE_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import locale, sys\n"
            "assert locale.getpreferredencoding(False).lower() in ('ascii', 'ansi_x3.4-1968'), "
            "locale.getpreferredencoding(False)\n"
            "from kernels.cpu import native\n"
            "sys.exit(0 if native.load_library() is not None else 3)\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            cwd=Path(cpu_native.__file__).parents[2])
    assert result.returncode == 0, result.stderr.decode("utf-8", "replace")[-3000:]
    assert list((tmp_path / "cache" / "cpu_kernels").glob("cpu_kernels-*.so"))
